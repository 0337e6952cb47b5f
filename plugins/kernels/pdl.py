"""Programmatic dependent launch (PDL) for the Triton kernels of a step: on Hopper and later, a
kernel launched with PDL may start while the kernel before it on the stream is still running,
so its launch, its programs' set-up and its reads of constant data (weights) overlap the previous
kernel's tail instead of following it. A decode step of a small model is a chain of a few hundred
short kernels, and that tail is a large part of each.

The contract every kernel launched with ``launch_pdl`` keeps (`begin` spells it):

* it lets the next kernel launch at once (``gdc_launch_dependents`` first: the next one can only
  take SM space that this kernel's own programs, all started by then, leave free);
* before it reads anything an earlier kernel may write, or writes anything an earlier kernel may
  read, it waits (``gdc_wait``: the previous grid has completed and its memory is visible).
  What it does before the wait is limited to loads of what no kernel of the step writes:
  weights and scales, the step's inputs (copied in before its first kernel starts) and the KV
  cache rows of earlier steps (the step writes only its new tokens' slots). Because each
  kernel waits for the one before it, and that one waited for its own predecessor, a kernel
  past its wait sees every earlier kernel complete;
* so every program waits before it exits, even one with nothing to do: a grid whose programs
  all returned without waiting could complete before its predecessor, and the kernel after it
  would no longer see that one.

Kernels without PDL (cuBLAS, torch's own) keep the stream's plain ordering, and a PDL kernel after
one of them simply starts when it completes. CUDA-graph capture keeps the programmatic edges.

``TRTC_PDL=0`` turns it off (benchmarks compare the two); it is off on GPUs before Hopper and in
Triton's CPU interpreter.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from trtc import envs
from trtc.gpu_profiles import has_feature

_enabled: bool | None = None  # None: TRTC_PDL, read at the first launch


def set_enabled(on: bool) -> bool:
    """Launches from now on use PDL (where the GPU has it) or not; a captured graph keeps what it
    was captured with. Returns the previous setting."""
    global _enabled
    was, _enabled = _setting(), on
    return was


def _setting() -> bool:
    global _enabled
    if _enabled is None:
        _enabled = envs.TRTC_PDL
    return _enabled


@functools.cache
def _device_has_pdl(index: int) -> bool:
    """Hopper or later, and a Triton that launches with PDL (its CUDA options know the flag)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return (
        "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
        and hasattr(tl.extra.cuda, "gdc_wait")
        and has_feature(index, "pdl")
    )


def enabled(device: torch.device) -> bool:
    """Whether kernels launched now on ``device`` use PDL."""
    return _setting() and _supported(device)


def _supported(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return _device_has_pdl(
        device.index if device.index is not None else torch.cuda.current_device()
    )


def launch_options(device: torch.device, want: bool | None = None) -> dict:
    """Keyword arguments for a Triton launch: ``PDL`` (the kernel's constexpr, for `begin`) and
    ``launch_pdl`` (the launch attribute). ``want`` overrides the module setting for this launch
    (a benchmark's variants); either way only where the GPU and Triton have PDL."""
    on = enabled(device) if want is None else (want and _supported(device))
    return {"PDL": on, "launch_pdl": on} if on else {"PDL": False}


@triton.jit
def begin(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (see the module's contract).
    Call it before the first access to data an earlier kernel may write."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
