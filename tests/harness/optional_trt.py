"""``tensorrt_rtx`` where it imports (``None`` elsewhere), and the skip mark of the tests that
need it."""

from __future__ import annotations

import pytest

try:
    import tensorrt_rtx as trt

    NO_TRT = ""
except Exception as e:  # ImportError, or a wheel whose native libraries do not load
    trt = None
    NO_TRT = (
        f"tensorrt_rtx is not importable ({type(e).__name__}: {e}); pip install tensorrt-rtx-cu13"
    )
needs_trt = pytest.mark.skipif(trt is None, reason=NO_TRT)
