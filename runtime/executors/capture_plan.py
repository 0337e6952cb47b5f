"""The graphs still to capture and the order they are captured in, a piece at a time.

A server's executor (``defer_graphs``) captures only a few graphs before it is ready and the
rest after, between steps: each piece (a graph's warm-up run, then its capture) takes a few
milliseconds of host time, so a step that comes meanwhile waits for one piece at most. Every
capture goes through here, also the ones done all at once (`CudaExecutor.capture_graphs`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence

import torch

from trtc.runtime.executors.cuda_graphs import GraphFamily, StaticInputs, synchronize

log = logging.getLogger("trtc.executor")


class CapturePlan:
    """``(family, size)`` pairs still to capture, in order, and the one whose warm-up has run
    (captured by the next piece). ``families``: those captured at start, in that order (their
    captured sizes end the log of a plan done)."""

    def __init__(self, families: Sequence[GraphFamily], device: torch.device):
        self.families, self.device = families, device
        self.pending: list[tuple[GraphFamily, Hashable]] = []
        self.warmed: tuple[GraphFamily, Hashable, StaticInputs] | None = None
        # Host seconds of the pieces: in all, and the longest (what a request arriving
        # meanwhile may wait), logged when the last is done.
        self.pieces_s, self.longest_piece_s = 0.0, 0.0

    def replan(self, families: Sequence[GraphFamily]) -> None:
        """Drop the graphs of ``families`` and list them for capture: family by family, each
        largest first (its smaller graphs reuse the largest's memory). The graphs of other
        families still to capture (the warmed one too) stay in the plan, after them."""
        synchronize(self.device)
        unfinished = [(w[0], w[1])] if (w := self.warmed) is not None else []
        self.warmed = None
        kept = [(f, s) for f, s in unfinished + self.pending if f not in families]
        for family in families:
            family.clear()
        self.pending = [
            (family, size)
            for family in families
            for size in sorted(family.capture_sizes, reverse=True)
        ] + kept

    def capture_now(self, family: GraphFamily, size: Hashable) -> None:
        """Capture ``family``'s graph of ``size`` at once (taken out of the plan)."""
        self.pending.remove((family, size))
        family.capture(size)

    def capture_next_piece(self) -> bool:
        """Warm up the next graph, or capture the warmed one; True while some are left."""
        if self.warmed is None and not self.pending:
            return False
        started = time.perf_counter()
        if self.warmed is not None:
            family, size, inputs = self.warmed
            family.record(size, inputs)
            self.warmed = None
        else:
            family, size = self.pending.pop(0)
            self.warmed = (family, size, family.warm(size))
        piece = time.perf_counter() - started
        self.pieces_s += piece
        self.longest_piece_s = max(self.longest_piece_s, piece)
        if self.warmed is None and not self.pending:
            log.info(
                "graphs: %s (after ready: %.2f s in pieces, the longest %.1f ms)",
                ", ".join(f"{f.label} {f.sizes}" for f in self.families),
                self.pieces_s,
                1000 * self.longest_piece_s,
            )
            return False
        return True
