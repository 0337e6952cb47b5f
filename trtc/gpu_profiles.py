"""GPU architecture profiles, read from ``configs/architectures.yaml`` (their one source): what
the compiler may target and which kernel features the runtime uses on a given GPU."""

from __future__ import annotations

from functools import cache
from importlib import resources

import yaml

FEATURES = ("mma_fragments", "fp8_matmul", "pdl", "bulk_prefetch")


@cache
def architecture_profiles() -> dict[str, dict]:
    text = resources.files("trtc.configs").joinpath("architectures.yaml").read_text()
    return yaml.safe_load(text)


def _capability(profile: dict) -> tuple[int, int]:
    major, minor = profile["compute_capability"].split(".")
    return int(major), int(minor)


def arch_name(capability: tuple[int, int]) -> str:
    """``sm90`` for compute capability (9, 0): the name tuning files and engines are kept
    under (any capability has one, listed in the profiles or not)."""
    return f"sm{capability[0]}{capability[1]}"


def profile_for(capability: tuple[int, int]) -> dict | None:
    """The profile of this compute capability, or of the highest one not above it (sm87 gets
    sm86's); None below every profile."""
    known = [p for p in architecture_profiles().values() if _capability(p) <= tuple(capability)]
    return max(known, key=_capability) if known else None


def features_of(capability: tuple[int, int]) -> frozenset[str]:
    profile = profile_for(capability)
    return frozenset(profile.get("features", ())) if profile else frozenset()


@cache
def _device_capability(index: int) -> tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(index))


def has_feature(device, feature: str) -> bool:
    """Whether kernels on ``device`` (a CUDA ``torch.device`` or its index) may use ``feature``
    (one of `FEATURES`), as the architecture profiles say."""
    if feature not in FEATURES:
        raise ValueError(f"{feature!r} is not a kernel feature (known: {', '.join(FEATURES)})")
    if not isinstance(device, int):
        if device.type != "cuda":
            return False
        device = _device_index(device)
    return feature in features_of(_device_capability(device))


def _device_index(device) -> int:
    """The index of a CUDA ``torch.device`` (the current device where it names none)."""
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


# The SM count planning assumes where the tensors are not on a GPU (Triton's CPU interpreter):
# an H100 SXM's.
DEFAULT_SM_COUNT = 132


@cache
def _device_sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (a ``torch.device``), which launch plans fill;
    `DEFAULT_SM_COUNT` off the GPU."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _device_sm_count(_device_index(device))
