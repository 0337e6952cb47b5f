"""The scripts of benchmarks/ as modules for tests: they are scripts, not a package, and import
their neighbours (``import timing``) as they do when run, so their folder goes on the path."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark_script(name: str) -> ModuleType:
    """``benchmarks/NAME.py``, imported."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    return importlib.import_module(name)
