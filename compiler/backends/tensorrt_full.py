"""Build full-TensorRT engines from the paged graph itself: the ``trtc`` plugin nodes stay and
run as the ``IPluginV3`` plugins of `trtc.plugins.tensorrt` (the KV cache updated in place
through an aliased plugin output), one engine per target architecture.

Full TensorRT builds on the GPU it builds for (it times kernels there), so a target must be the
local GPU's compute capability; ``hardware_compatibility="ampere_plus"`` instead builds one
engine that runs on every Ampere or newer GPU (TensorRT's AMPERE_PLUS level: fewer tactics,
48 KiB of shared memory per block). Timing caches persist per target in the user's cache
directory (the build output is replaced on each build; the cache must outlive it).

Building needs full TensorRT and the target GPU; the tests check what can be checked without
them (see docs/design-notes.md, "Full TensorRT backend and the TensorRT executor").
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx

from trtc import artifact, envs
from trtc.artifact import Limits, Manifest, TensorRecord
from trtc.compiler.backends.tensorrt_rtx import build_plan, engine_record, network_io, parse_network
from trtc.compiler.targets import check_known, describe_targets
from trtc.contract import (
    MAX_BLOCKS,
    NUM_BLOCKS,
    NUM_LOGITS,
    NUM_SEQS,
    NUM_TOKENS,
    kv_input_name,
    kv_output_name,
)
from trtc.errors import BuildError, ConfigError
from trtc.gpu_profiles import architecture_profiles
from trtc.plugins import PLUGINS
from trtc.plugins.spec import DOMAIN
from trtc.plugins.tensorrt.logger import make_logger

BACKEND = "tensorrt"
ENGINE_DIR = "engines"
KV_LAYOUT = "paged"
HARDWARE_COMPATIBILITY = ("none", "ampere_plus")
INSTALL_HINT = (
    "'tensorrt' needs full TensorRT >= 10 with its Python bindings, which this machine "
    "does not have (install it from NVIDIA's package index on a machine with the target "
    "GPU: pip install tensorrt-cu12, or tensorrt-cu13); to build engines without a GPU use "
    "backend tensorrt-rtx"
)


def import_trt():
    try:
        import tensorrt as trt
    except (ImportError, OSError) as e:  # not installed, or bindings without libnvinfer
        raise BuildError(f"{INSTALL_HINT} [{type(e).__name__}: {e}]") from None
    return trt


def local_gpu() -> tuple[str, str] | None:
    """``(name, compute capability "9.0")`` of CUDA device 0, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return torch.cuda.get_device_name(0), f"{major}.{minor}"


def _cc(version: str) -> tuple[int, int]:
    major, minor = version.split(".")
    return int(major), int(minor)


def check_targets(targets: list[str], hardware_compatibility: str = "none") -> None:
    """Refuse, before any work, targets this machine cannot build full TensorRT engines for."""
    profiles = architecture_profiles()
    if hardware_compatibility not in HARDWARE_COMPATIBILITY:
        raise ConfigError(
            f"backend.hardware_compatibility: {hardware_compatibility!r} (allowed: "
            f"{', '.join(HARDWARE_COMPATIBILITY)})"
        )
    check_known(targets)
    if not targets:
        raise ConfigError(f"backend.targets: backend {BACKEND} needs at least one target")
    gpu = local_gpu()
    if gpu is None:
        raise ConfigError(
            f"backend.targets: backend {BACKEND} builds on a machine with the target GPU "
            f"(TensorRT times its kernels there) and this machine has no CUDA device; "
            f"build there, or use backend tensorrt-rtx (CPU-only builds)"
        )
    name, here = gpu
    if hardware_compatibility == "ampere_plus":
        old = [t for t in targets if _cc(profiles[t]["compute_capability"]) < (8, 0)]
        if _cc(here) < (8, 0) or old:
            raise ConfigError(
                f"backend.hardware_compatibility: ampere_plus engines are built on and "
                f"run on compute capability 8.0 or newer (this GPU, {name}, is {here}"
                + (f"; targets {', '.join(old)} are older" if old else "")
                + ")"
            )
        return
    other = [t for t in targets if profiles[t]["compute_capability"] != here]
    if other:
        raise ConfigError(
            f"backend.targets: full TensorRT builds for the GPU it runs on, and this one "
            f"is {name} (compute capability {here}); build {describe_targets(other)} on such "
            f"a GPU, or ask for hardware_compatibility ampere_plus"
        )


def prepare_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """The paged graph as the TensorRT parser needs it: every plugin node names its plugin version
    and namespace (the parser's defaults are "1" and ""), its attributes are checked as plugin
    fields (a bad node fails here, by name), and uint8 plugin inputs are retyped int8 (same
    bytes: TensorRT plugins take no uint8, `rules.CARRIED_AS`)."""
    from trtc.plugins.tensorrt import rules

    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.domain != DOMAIN or node.op_type not in PLUGINS:
            continue
        spec = PLUGINS[node.op_type]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        try:
            rules.parse_fields(spec, rules.fields_from_attributes(spec, attrs))
        except rules.PluginFieldError as e:
            raise BuildError(f"backend {BACKEND}: node {node.name}: {e}") from None
        node.attribute.extend(
            [
                onnx.helper.make_attribute("plugin_version", str(spec.version)),
                onnx.helper.make_attribute("plugin_namespace", DOMAIN),
            ]
        )
        for name, tensor in zip(spec.inputs, node.input):
            if (
                tensor in inits
                and inits[tensor].data_type == onnx.TensorProto.UINT8
                and rules.INPUT_DTYPES[spec.op_type][name] == ("uint8",)
            ):
                inits[tensor].data_type = onnx.TensorProto.INT8
    return model


def paged_profile(
    io_inputs: list[TensorRecord], limits: Limits, block_size: int
) -> dict[str, tuple[tuple, tuple, tuple]]:
    """min/opt/max of every contract input. opt is the in-flight decode step (every sequence
    busy, one token each). The KV pool ranges up to every sequence at full context; only the
    plugin reads it, so the range costs nothing. ``logits_indices`` ranges like the token axis:
    a step may ask for the logits of any tokens (``trtc eval`` asks for all of them)."""
    max_seqs, max_tokens = int(limits.max_num_seqs), int(limits.max_num_tokens)
    blocks_per_seq = -(-int(limits.max_seq_len) // block_size)
    decode = min(max_seqs, max_tokens)
    dims = {
        NUM_TOKENS: (1, decode, max_tokens),
        NUM_SEQS: (1, max_seqs, max_seqs),
        "num_seqs_plus_1": (2, max_seqs + 1, max_seqs + 1),
        MAX_BLOCKS: (1, blocks_per_seq, blocks_per_seq),
        NUM_BLOCKS: (1, blocks_per_seq * max_seqs, blocks_per_seq * max_seqs),
    }
    dims[NUM_LOGITS] = dims[NUM_TOKENS]  # any tokens' logits (`trtc eval` asks for all)
    profile = {}
    for t in io_inputs:
        shape = [dims[d] if isinstance(d, str) else (d, d, d) for d in t.shape]
        profile[t.name] = tuple(tuple(s[k] for s in shape) for k in range(3))
    return profile


def timing_cache_path(
    target: str,
    trt_version: str,
    hardware_compatibility: str = "none",
    cache_dir: str | Path | None = None,
) -> Path:
    """``$TRTC_CACHE_DIR`` or ``$XDG_CACHE_HOME/trtc`` or ``~/.cache/trtc``, then
    ``timing/<target>-tensorrt-<version>[-ampere_plus].cache``."""
    root = cache_dir or envs.cache_dir()
    suffix = "" if hardware_compatibility == "none" else f"-{hardware_compatibility}"
    return Path(root) / "timing" / f"{target}-{BACKEND}-{trt_version}{suffix}.cache"


def _load_timing_cache(config, path: Path, log) -> None:
    data = path.read_bytes() if path.is_file() else b""
    cache = config.create_timing_cache(data)
    if not config.set_timing_cache(cache, ignore_mismatch=False):
        log(f"tensorrt: timing cache {path} is for another GPU or version; starting a new one")
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)
    elif data:
        log(f"tensorrt: reusing timing cache {path}")


def _save_timing_cache(config, path: Path, log) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(bytes(config.get_timing_cache().serialize()))
        os.replace(tmp, path)
    except OSError as e:  # an optimisation: a read-only cache must not fail the build
        log(f"tensorrt: could not save the timing cache {path}: {e}")


def build_tensorrt_engines(
    model: onnx.ModelProto,
    out_dir: Path,
    targets: list[str],
    manifest: Manifest,
    log: Callable[[str], None] = print,
    hardware_compatibility: str = "none",
    cache_dir: str | Path | None = None,
) -> list[dict]:
    """Build ``out_dir/engines/<target>.engine`` (one ``ampere_plus.engine`` for all targets at
    that level) from the paged graph; one manifest record per target."""
    trt = import_trt()
    check_targets(targets, hardware_compatibility)
    from trtc.plugins.tensorrt import register_plugins

    register_plugins(trt)
    gpu_name, _ = local_gpu()
    messages: list[str] = []
    logger = make_logger(trt, BACKEND, log, messages)
    builder = trt.Builder(logger)
    with tempfile.TemporaryDirectory(prefix="trtc-trt-") as tmp:  # kept until the builds end
        network, parser = parse_network(trt, builder, prepare_graph(model), Path(tmp), BACKEND)
        io, aliases = _engine_io(trt, network, manifest)
        shapes = paged_profile(manifest.io.inputs, manifest.limits, manifest.kv_cache.block_size)
        (Path(out_dir) / ENGINE_DIR).mkdir(parents=True, exist_ok=True)
        shared = hardware_compatibility == "ampere_plus"
        records, plan_file = [], None
        for target in targets:
            rel = f"{ENGINE_DIR}/{'ampere_plus' if shared else target}.engine"
            if plan_file is None or not shared:  # one ampere_plus engine serves every target
                plan_file = Path(out_dir) / rel
                seconds = _build_engine(
                    trt,
                    builder,
                    network,
                    shapes,
                    messages,
                    target,
                    plan_file,
                    rel,
                    gpu_name,
                    hardware_compatibility,
                    cache_dir,
                    log,
                )
            else:
                seconds = 0.0  # the shared engine was built for the first target
            records.append(
                engine_record(
                    trt,
                    target,
                    BACKEND,
                    manifest.precision,
                    KV_LAYOUT,
                    rel,
                    plan_file,
                    seconds,
                    shapes,
                    io,
                    aliases,
                    hardware_compatibility=hardware_compatibility,
                )
            )
        del parser, network  # the parser owns the weights until the builds end
    return records


def _engine_io(trt, network, manifest: Manifest) -> tuple[dict, dict[str, str]]:
    """The network's inputs and outputs as the manifest names their dtypes, and the updated
    caches' aliases (each updated cache checked to be a network output)."""
    from trtc.plugins.tensorrt import rules

    num_layers = manifest.kv_cache.num_layers
    aliases = {kv_output_name(i): kv_input_name(i) for i in range(num_layers)}
    outputs = {network.get_output(i).name for i in range(network.num_outputs)}
    if missing := sorted(set(aliases) - outputs):
        raise BuildError(f"backend {BACKEND}: updated caches {missing} are not network outputs")
    contract_shapes = {t.name: tuple(t.shape) for t in manifest.io.inputs + manifest.io.outputs}
    io = network_io(trt, network, contract_shapes)
    for t in io["inputs"] + io["outputs"]:  # the manifest's dtype names (fp8, not FP8)
        t["dtype"] = rules.TRT_DTYPE_NAMES.get(t["dtype"], t["dtype"])
    return io, aliases


def _build_engine(
    trt,
    builder,
    network,
    shapes: dict,
    messages: list[str],
    target: str,
    plan_file: Path,
    rel: str,
    gpu_name: str,
    hardware_compatibility: str,
    cache_dir: str | Path | None,
    log: Callable[[str], None],
) -> float:
    """Build one engine for ``target`` on the GPU ``gpu_name`` into ``plan_file`` (``rel`` in
    the artifact), with the target's timing cache read before and saved after; returns the
    build's seconds."""
    cache_path = timing_cache_path(target, trt.__version__, hardware_compatibility, cache_dir)

    def configure(config):
        # The KV cache is updated in place (an aliased plugin output).
        config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
        # Otherwise NONE, TensorRT's default: the fastest engine, for this GPU's cc.
        if hardware_compatibility == "ampere_plus":
            level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
            config.hardware_compatibility_level = level
        _load_timing_cache(config, cache_path, log)

    log(f"tensorrt {trt.__version__}: building {rel} on {gpu_name} ...")
    plan, seconds, config = build_plan(
        builder, network, shapes, messages, BACKEND, target, configure
    )
    _save_timing_cache(config, cache_path, log)
    plan_file.write_bytes(plan)
    del plan
    size_mb = plan_file.stat().st_size / 1e6
    log(f"tensorrt: built {rel} in {seconds:.1f}s ({size_mb:.1f} MB)")
    return seconds


def build_tensorrt(
    staging: Path, manifest: Manifest, cfg, progress, hardware_compatibility: str = "none"
) -> list[dict]:
    """Stage 5 of `trtc build` for backend tensorrt, from the graph just written to ``staging``."""
    targets = cfg.backend.targets
    with progress.stage("engines", f"building TensorRT engines for {', '.join(targets)}") as done:
        written = onnx.load(str(staging / artifact.MODEL_FILE))  # the weights come along
        records = build_tensorrt_engines(
            written,
            staging,
            targets,
            manifest,
            log=progress.log,
            hardware_compatibility=hardware_compatibility,
        )
        done["detail"] = ", ".join(f"{r['target']} {r['bytes'] / 1e6:.0f} MB" for r in records)
    return records
