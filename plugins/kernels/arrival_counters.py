"""Arrival counters for split kernels whose last program finishes the job (one launch instead of a
kernel for the partial results and a second one that merges them).

Each program of a split group stores its partial result, then adds 1 to the group's int32
counter (acq_rel, GPU scope); the program that sees ``splits - 1`` arrived before it merges the
partials and sets the counter back to 0, so the buffer is zero again after every launch and can be
reused by the next launch, inside a CUDA graph too. Launches on one stream run one after the
other, so kernels of different kinds share a stream's counters.
"""

from __future__ import annotations

import torch

_counters: dict[tuple, torch.Tensor] = {}


def arrival_counters(device: torch.device, groups: int) -> torch.Tensor:
    """Zeroed int32 counters, at least ``groups`` of them, kept per device and stream and grown
    when a launch needs more."""
    key = (device, torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0)
    counters = _counters.get(key)
    if counters is None or counters.numel() < groups:
        counters = torch.zeros(max(groups, 1024), dtype=torch.int32, device=device)
        _counters[key] = counters
    return counters


def all_zero() -> bool:
    """Every counter back at zero (what each launch must leave behind)."""
    return all(int(c.abs().sum()) == 0 for c in _counters.values())
