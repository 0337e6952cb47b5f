"""A logger for TensorRT and TensorRT-RTX (the same Python API; the module is passed in), used
by the compiler's engine builds and by the runtime's TensorRT executor."""

from __future__ import annotations

from collections.abc import Callable


def make_logger(
    trt, label: str, log: Callable[[str], None], messages: list[str], ignore: tuple[str, ...] = ()
):
    """A TensorRT (or TensorRT-RTX: the same API) logger that keeps errors in ``messages`` for
    the error raised afterwards and passes warnings on, except those containing an ``ignore``
    text."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            if severity in (trt.ILogger.INTERNAL_ERROR, trt.ILogger.ERROR):
                messages.append(msg)
                log(f"{label} error: {msg}")
            elif severity == trt.ILogger.WARNING and not any(t in msg for t in ignore):
                log(f"{label} warning: {msg}")

    return Logger()
