"""How a child process ended, in words, for the errors that report it (a tensor-parallel
worker, the engine process)."""

from __future__ import annotations

import signal


def exit_reason(code: int | None) -> str:
    """``Popen.returncode`` / ``Process.exitcode`` in words: a signal by its name."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
