"""Every ``TRTC_*`` environment variable trtc reads: its meaning, its default and how it is
parsed, in one place. Read as attributes (``envs.TRTC_PDL``) when used, never at import, so a
test or a benchmark that sets one before it builds an engine sees its value. Two are read once
per process, at the first kernel launch that consults them, because every launch does:
``TRTC_PDL`` and ``TRTC_GEMV_MAX_TOKENS`` (``pdl.set_enabled`` and ``gemv.set_max_tokens``
change them afterwards).

``python -m trtc.envs`` lists them with their current values.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _flag(name: str, default: bool) -> Callable[[], bool]:
    """On unless set to 0 (or off unless set to something else than 0, for default False)."""
    return lambda: os.environ.get(name, "1" if default else "0") != "0"


def _int(name: str, default: int) -> Callable[[], int]:
    return lambda: int(os.environ.get(name, str(default)))


def _path(name: str) -> Callable[[], Path | None]:
    return lambda: Path(os.environ[name]) if os.environ.get(name) else None


def _str(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or None


# name -> (reader, meaning)
ENVIRONMENT: dict[str, tuple[Callable[[], Any], str]] = {
    "TRTC_API_KEY": (
        _str("TRTC_API_KEY"),
        "the API key `trtc serve` requires (and `trtc bench --url` sends) when --api-key is not "
        "given",
    ),
    "TRTC_ASYNC_SCHEDULING": (
        _flag("TRTC_ASYNC_SCHEDULING", True),
        "0: the cuda executor waits for each step's tokens before queuing the next (default: a "
        "decode step is queued before the previous one's tokens are read)",
    ),
    "TRTC_ENGINE_PROCESS": (
        _flag("TRTC_ENGINE_PROCESS", True),
        "0: `trtc serve` steps the engine on a thread of the server's process instead of in a "
        "process of its own (where the HTTP handlers do not share its interpreter lock)",
    ),
    "TRTC_INT4_FRAGMENTS": (
        _flag("TRTC_INT4_FRAGMENTS", True),
        "0: the cuda executor keeps INT4 weights in the stored plugin layout instead of the "
        "fragment kernel's",
    ),
    "TRTC_MIXED_GRAPHS": (
        _flag("TRTC_MIXED_GRAPHS", True),
        "0: the cuda executor runs prefill and mixed prefill + decode steps eagerly instead of "
        "replaying them from graphs captured per token bucket (which hold GPU memory: the "
        "largest bucket's activations)",
    ),
    "TRTC_FIT_TOKEN_BUCKETS": (
        _flag("TRTC_FIT_TOKEN_BUCKETS", True),
        "0: the scheduler does not cut a prefill / mixed step down to the executor's token "
        "bucket below it (by default it does when that defers fewer prompt tokens to the next "
        "step than the bucket above would pad)",
    ),
    "TRTC_TUNING": (
        _flag("TRTC_TUNING", True),
        "0: the cuda executor ignores an artifact's `trtc tune` kernels and choices (compiles "
        "at start, as for an untuned artifact)",
    ),
    "TRTC_GEMV_MAX_TOKENS": (
        _int("TRTC_GEMV_MAX_TOKENS", 2),
        "projections of at most this many tokens run the Triton GEMV, longer ones cuBLAS (0: "
        "always cuBLAS)",
    ),
    "TRTC_PDL": (
        _flag("TRTC_PDL", True),
        "0: Triton kernels launch without programmatic dependent launch (it is used on Hopper "
        "and later only)",
    ),
    "TRTC_DISTRIBUTED_TIMEOUT": (
        _int("TRTC_DISTRIBUTED_TIMEOUT", 600),
        "seconds a tensor-parallel rank waits in one collective of a step before it fails "
        "(an idle server's workers wait for the next step without limit)",
    ),
    "TRTC_CACHE_DIR": (
        _path("TRTC_CACHE_DIR"),
        "where full-TensorRT builds keep their timing caches and `trtc serve` unpacks a tuned "
        "artifact's kernels (default $XDG_CACHE_HOME/trtc or "
        "~/.cache/trtc)",
    ),
}


def cache_dir() -> Path:
    """``$TRTC_CACHE_DIR``, else ``$XDG_CACHE_HOME/trtc``, else ``~/.cache/trtc``."""
    return (
        ENVIRONMENT["TRTC_CACHE_DIR"][0]()
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtc"
    )


def __getattr__(name: str) -> Any:
    if name in ENVIRONMENT:
        return ENVIRONMENT[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(ENVIRONMENT)


if __name__ == "__main__":
    for key, (read, meaning) in ENVIRONMENT.items():
        print(f"{key}={read()!r}\n    {meaning}")
