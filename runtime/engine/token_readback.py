"""Sampled token ids on their way from the device to the host, without waiting for the stream.

An async engine queues step n+1 before it reads step n's tokens. A plain ``.tolist()`` on the
GPU tensor would wait for everything queued on the stream, step n+1 included; instead the ids
are copied into a pinned buffer behind step n's kernels and an event is recorded after the copy,
so reading them waits for step n alone."""

from __future__ import annotations

from collections.abc import Callable

import torch


class TokenReadback:
    """Two pinned buffers used in turn: at most two steps are unread at a time (the one being
    read and the one queued ahead of it), and a buffer is written again only by a copy queued
    after the step that last used it was read (or dropped: then nothing reads it)."""

    def __init__(self, device: torch.device, capacity: int):
        self.on_gpu = device.type == "cuda"
        if self.on_gpu:
            self.buffers = [
                torch.empty(capacity, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
            self.events = [torch.cuda.Event() for _ in range(2)]
            self.turn = 0

    def start(self, ids: torch.Tensor) -> Callable[[], list[int]]:
        """Start copying ``ids`` to the host; the returned function waits for them."""
        if not self.on_gpu:
            return ids.tolist
        buffer, event = self.buffers[self.turn][: ids.numel()], self.events[self.turn]
        self.turn ^= 1
        buffer.copy_(ids, non_blocking=True)
        event.record()

        def read() -> list[int]:
            event.synchronize()
            return buffer.tolist()

        return read
