"""Which of an artifact's engines this host can run, and why not: one answer for the TensorRT
executor that loads them and for `trtc inspect` that lists them, so the two never disagree."""

from __future__ import annotations

import importlib

from trtc.artifact import EngineRecord, Manifest

RUNTIMES = {  # engine backend -> (module that runs it, how to install it)
    "tensorrt": (
        "tensorrt",
        "pip install tensorrt-cu12 (or tensorrt-cu13) from NVIDIA's package index",
    ),
    "tensorrt-rtx": ("tensorrt_rtx", "pip install tensorrt-rtx-cu13"),
}


def engine_refusal(engine: EngineRecord) -> str | None:
    """Why this host cannot run ``engine``, or None if it can. Checked in the order that needs
    the least: the device, its compute capability (no TensorRT import yet), then the runtime
    module and its version."""
    import torch

    if not torch.cuda.is_available():
        return "this host has no GPU (no CUDA device visible to torch)"
    major, minor = torch.cuda.get_device_capability()
    gpu = f"{torch.cuda.get_device_name()}, compute capability {major}.{minor}"
    if engine.hardware_compatibility == "ampere_plus":
        if (major, minor) < (8, 0):
            return (
                f"engine {engine.target} is built for Ampere or newer (compute capability "
                f">= 8.0); this GPU is {gpu}"
            )
    elif engine.compute_capability != f"{major}.{minor}":
        return (
            f"engine {engine.target} is for compute capability {engine.compute_capability}; "
            f"this GPU is {gpu}"
        )
    if engine.backend not in RUNTIMES:
        known = ", ".join(RUNTIMES)
        return f"engine backend {engine.backend!r} is unknown to this trtc (known: {known})"
    module, hint = RUNTIMES[engine.backend]
    try:
        trt = importlib.import_module(module)
    except Exception as e:  # ImportError, or bindings whose native libraries do not load
        return (
            f"the {module} runtime is not importable ({type(e).__name__}: {e}); install it: {hint}"
        )
    if trt.__version__ != engine.trt_version:
        return (
            f"engine {engine.target} was built with {engine.backend} {engine.trt_version} and "
            f"this host has {trt.__version__} (a plan loads only in the version that built it: "
            f"rebuild it)"
        )
    return None


def choose_engine(manifest: Manifest) -> tuple[EngineRecord | None, list[str]]:
    """The first engine record this host can run, else None and why each one cannot."""
    if not manifest.engines:
        return None, [
            "the artifact has no engines (build it with backend tensorrt or tensorrt-rtx)"
        ]
    reasons = []
    for e in manifest.engines:
        why = engine_refusal(e)
        if why is None:
            return e, []
        reasons.append(f"engine {e.target} ({e.backend} {e.trt_version}, {e.file}): {why}")
    return None, reasons
