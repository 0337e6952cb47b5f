"""Peak resident memory of the build process, per stage.

On Linux the kernel keeps the process's resident high-water mark (``VmHWM`` in
``/proc/self/status``) and resets it when "5" is written to ``/proc/self/clear_refs``: each stage
resets it at its start and reads it at its end. The kernel raises that mark only at some events
(an unmap, exit), not when memory is handed back with ``madvise`` as allocators do, so one
background thread also samples the resident size every 20 ms, and a stage's peak is the larger
of the two. Where the reset is refused the samples alone count; where there is no ``/proc``
only the process's lifetime peak (``ru_maxrss``) exists, and every stage reports that.
"""

from __future__ import annotations

import resource
import sys
import threading
import weakref

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kb(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int | None:
    """Resident bytes now (None where the OS does not tell: no /proc)."""
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


def lifetime_peak() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _reset_high_water_mark() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class _Sampler:
    """One daemon thread that raises every live meter's sampled peak every 20 ms."""

    meters: weakref.WeakSet = weakref.WeakSet()
    lock = threading.Lock()
    thread: threading.Thread | None = None

    @classmethod
    def watch(cls, meter: PeakMeter) -> None:
        with cls.lock:
            cls.meters.add(meter)
            if cls.thread is None:
                cls.thread = threading.Thread(target=cls._run, daemon=True, name="trtc-rss")
                cls.thread.start()

    @classmethod
    def _run(cls) -> None:
        tick = threading.Event()
        while not tick.wait(0.02):
            rss = current_rss() or 0
            with cls.lock:
                for meter in list(cls.meters):
                    meter.sampled = max(meter.sampled, rss)


class PeakMeter:
    """``reset()`` then ``peak()``: the most bytes resident at once in between. ``how`` says
    which way (module docstring) it measures."""

    def __init__(self):
        self.sampled = current_rss()
        if self.sampled is None:
            self.how = "process lifetime peak (ru_maxrss: no per-stage figure on this OS)"
            return
        _Sampler.watch(self)
        if _status_kb("VmHWM") is not None and _reset_high_water_mark():
            self.how = "VmHWM per stage and RSS sampled every 20 ms"
        else:
            self.how = "RSS sampled every 20 ms"

    @property
    def uses_high_water_mark(self) -> bool:
        return self.how.startswith("VmHWM")

    def reset(self) -> None:
        if self.sampled is None:
            return
        if self.uses_high_water_mark:
            _reset_high_water_mark()
        with _Sampler.lock:
            self.sampled = current_rss() or 0

    def peak(self) -> int:
        if self.sampled is None:
            return lifetime_peak()
        with _Sampler.lock:
            self.sampled = max(self.sampled, current_rss() or 0)
            sampled = self.sampled
        if self.uses_high_water_mark:
            return max(sampled, (_status_kb("VmHWM") or 0) * 1024)
        return sampled


def gb(n: int) -> str:
    """Bytes for a person: GB, or MB below 0.1 GB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
