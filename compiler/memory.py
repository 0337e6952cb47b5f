"""Peak resident memory of the build process, per stage.

On Linux the kernel keeps the process's resident high-water mark (``VmHWM`` in
``/proc/self/status``) and resets it when "5" is written to ``/proc/self/clear_refs``: each stage
resets it at its start and reads it at its end, which gives that stage's own peak, exactly,
with no sampling. Where that is not possible (another OS, a kernel that refuses the reset) a
background thread samples the resident size every 20 ms instead.
"""

from __future__ import annotations

import resource
import sys
import threading

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


def current_rss() -> int:
    """Resident bytes now."""
    kb = _status_kb("VmRSS")
    if kb is not None:
        return kb * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class PeakMeter:
    """``reset()`` then ``peak()``: the most bytes resident at once in between."""

    def __init__(self):
        self.exact = self._can_reset()
        self._sampled = 0
        self._lock = threading.Lock()
        if not self.exact:
            self._sampled = current_rss()
            threading.Thread(target=self._sample, daemon=True, name="trtc-rss").start()

    @staticmethod
    def _can_reset() -> bool:
        if _status_kb("VmHWM") is None:
            return False
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")
        except OSError:
            return False
        return True

    def _sample(self) -> None:
        event = threading.Event()
        while not event.wait(0.02):
            rss = current_rss()
            with self._lock:
                self._sampled = max(self._sampled, rss)

    def reset(self) -> None:
        if self.exact:
            try:
                with open(_CLEAR_REFS, "w") as f:
                    f.write("5")
                return
            except OSError:
                self.exact = False
                threading.Thread(target=self._sample, daemon=True, name="trtc-rss").start()
        with self._lock:
            self._sampled = current_rss()

    def peak(self) -> int:
        if self.exact:
            kb = _status_kb("VmHWM")
            if kb is not None:
                return kb * 1024
        rss = current_rss()
        with self._lock:
            self._sampled = max(self._sampled, rss)
            return self._sampled


def gb(n: int) -> str:
    """Bytes for a person: GB, or MB below 0.1 GB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
