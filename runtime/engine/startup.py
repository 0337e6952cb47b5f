"""Start-up phases: how long each stage of bringing an engine up took (interpreter and imports,
CUDA context, weights, kernels, graphs, ...), logged as they end and exported on /metrics
(``trtc_startup_seconds{phase}``). A replica's time to ready is the sum, and the phases say
where it went."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from contextlib import contextmanager

log = logging.getLogger("trtc.startup")


def seconds_since_process_start() -> float | None:
    """Wall time since this process was started (Linux: /proc), None where it cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks after boot); the command name may hold spaces.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:  # seconds after boot, the clock starttime counts on
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def modules_without_bytecode(names: tuple[str, ...]) -> list[str]:
    """Those of the imported modules ``names`` whose compiled bytecode is not cached: every
    process that imports them compiles their sources first (for torch, seconds of each start),
    as in an environment installed with ``pip --no-compile`` and run with
    ``PYTHONDONTWRITEBYTECODE`` set, or read-only."""
    missing = []
    for name in names:
        source = getattr(sys.modules.get(name), "__file__", None) or ""
        if source.endswith(".py"):
            try:
                cached = importlib.util.cache_from_source(source)
            except NotImplementedError:  # no bytecode caching in this interpreter
                continue
            if not os.path.exists(cached):
                missing.append(name)
    return missing


def warn_if_uncompiled(names: tuple[str, ...]) -> None:
    """Say so, with the fix, when `modules_without_bytecode` finds any of ``names``."""
    missing = modules_without_bytecode(names)
    if missing:
        where = os.path.dirname(os.path.dirname(sys.modules[missing[0]].__file__))
        log.warning(
            "%s: no compiled bytecode in this Python environment, so each start compiles "
            "their sources (seconds); compile them once (`python -m compileall -q %s`) or, "
            "where it is read-only, give Python a writable cache (PYTHONPYCACHEPREFIX=DIR)",
            ", ".join(missing),
            where,
        )


class StartupPhases:
    """Named phases in the order they ran, with seconds and a note each."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.notes: dict[str, str] = {}

    @contextmanager
    def phase(self, name: str, note: str = ""):
        """Time the block as ``name`` (added to an earlier phase of that name)."""
        start = time.perf_counter()
        try:
            yield self
        finally:
            self.record(name, time.perf_counter() - start, note)

    def record(self, name: str, seconds: float, note: str = "") -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        if note:
            self.notes[name] = note
        note = self.notes.get(name, "")
        log.info("start-up: %s %.2f s%s", name, seconds, f" ({note})" if note else "")

    def note(self, name: str, note: str) -> None:
        """Say what a phase did once it is known (kernels loaded or compiled, sizes captured)."""
        self.notes[name] = note

    def update(self, other: StartupPhases) -> None:
        for name, seconds in other.seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.notes.update(other.notes)

    def summary(self) -> str:
        return ", ".join(
            f"{name} {s:.2f} s" + (f" ({self.notes[name]})" if name in self.notes else "")
            for name, s in self.seconds.items()
        )
