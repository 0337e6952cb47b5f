"""Stage-by-stage progress: a live spinner and a line per finished stage on a terminal, plain
timestamped lines otherwise (CI logs, pipes). Every line also goes to the artifact's build.log.
Each finished stage says its time and its peak resident memory (`compiler.memory`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import UTC, datetime

from rich.console import Console

from trtc.compiler.memory import PeakMeter, gb


class Progress:
    def __init__(
        self,
        interactive: bool | None = None,
        quiet: bool = False,
        interrupted: Callable[[], bool] | None = None,
    ):
        """``interrupted()``: whether the user interrupted the build. Checked as each stage
        starts and ends, so an interrupt that arrived while Python could not raise it (inside
        a finaliser, which swallows exceptions) still stops the build at the next boundary."""
        self.interrupted = interrupted or (lambda: False)
        self.console = Console(stderr=True, highlight=False)
        self.interactive = self.console.is_terminal if interactive is None else interactive
        self.quiet = quiet
        self.lines: list[str] = []
        self._status = None
        self.meter = PeakMeter()
        self.stage_peaks: dict[str, int] = {}  # stage name -> peak resident bytes
        self._outside_stages = self.meter.peak()  # imports, and the work between stages

    @property
    def peak_bytes(self) -> int:
        """The build's peak resident memory so far (every stage and the work between)."""
        self._outside_stages = max(self._outside_stages, self.meter.peak())
        return max([self._outside_stages, *self.stage_peaks.values()])

    def memory_record(self) -> dict:
        """For the manifest: peak resident bytes in all and per stage."""
        return {
            "peak_rss_bytes": self.peak_bytes,
            "measured": self.meter.how,
            "stages": dict(self.stage_peaks),
        }

    def log(self, message: str) -> None:
        stamp = datetime.now(UTC).strftime("%H:%M:%S")
        self.lines.append(f"{stamp} {message}")
        if self.quiet:
            return
        if self.interactive:
            self.console.print(message, markup=False)
        else:
            print(f"[trtc {stamp}] {message}", file=sys.stderr, flush=True)

    @contextmanager
    def stage(self, name: str, description: str):
        """Run one stage; the body may set ``done["detail"]`` to say what it did."""
        if self.interrupted():
            raise KeyboardInterrupt
        done = {"detail": ""}
        self._outside_stages = max(self._outside_stages, self.meter.peak())
        self.meter.reset()
        start = time.perf_counter()
        if not self.interactive:
            self.log(f"{name}: {description} ...")
        status = (
            self.console.status(f"[bold]{name}[/]: {description}")
            if self.interactive and not self.quiet
            else None
        )
        if status:
            status.start()
        self._status = (name, status)
        try:
            yield done
        except BaseException:
            if status:
                status.stop()
            self._status = None
            peak = self._record_peak(name)
            self.log(f"{name}: failed after {time.perf_counter() - start:.1f}s (peak {gb(peak)})")
            raise
        self._status = None
        if status:
            status.stop()
        if self.interrupted():
            self.log(f"{name}: interrupted after {time.perf_counter() - start:.1f}s")
            raise KeyboardInterrupt
        peak = self._record_peak(name)
        detail = f" — {done['detail']}" if done["detail"] else ""
        mark = "✓ " if self.interactive else ""
        self.log(
            f"{mark}{name}: done in {time.perf_counter() - start:.1f}s, peak {gb(peak)}{detail}"
        )

    def _record_peak(self, name: str) -> int:
        peak = self.meter.peak()
        self.stage_peaks[name] = max(self.stage_peaks.get(name, 0), peak)
        self.meter.reset()
        return peak

    def update(self, message: str) -> None:
        """Progress inside the running stage (a long one: calibration layer by layer): the live
        status line on a terminal, a log line otherwise; always in build.log."""
        if self._status is None:
            self.log(message)
            return
        name, status = self._status
        if status is not None:
            self.lines.append(f"{datetime.now(UTC).strftime('%H:%M:%S')} {name}: {message}")
            status.update(f"[bold]{name}[/]: {message}")
        else:
            self.log(f"{name}: {message}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"
