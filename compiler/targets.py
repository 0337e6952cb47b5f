"""Build targets checked against the GPU architecture profiles (`trtc.gpu_profiles`)."""

from __future__ import annotations

from trtc.errors import ConfigError
from trtc.gpu_profiles import architecture_profiles


def check_known(targets: list[str]) -> None:
    """Refuse targets the profiles do not list, naming those they do."""
    profiles = architecture_profiles()
    unknown = [t for t in targets if t not in profiles]
    if unknown:
        raise ConfigError(
            f"backend.targets: {', '.join(unknown)} not a known architecture "
            f"(allowed: {', '.join(profiles)})"
        )


def describe_targets(targets: list[str]) -> str:
    """``sm86 (RTX 3090, compute capability 8.6), ...``: how a refusal names targets."""
    profiles = architecture_profiles()
    return ", ".join(
        f"{t} ({profiles[t]['example']}, compute capability {profiles[t]['compute_capability']})"
        for t in targets
    )


def quantization_format(method: str) -> str | None:
    """The hardware format a quantization method needs (None for unquantized)."""
    return {"none": None, "rtn": "int4", "awq": "int4", "gptq": "int4", "fp8": "fp8"}[method]
