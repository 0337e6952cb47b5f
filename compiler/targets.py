"""GPU architecture profiles, read from ``configs/architectures.yaml`` (their one source)."""

from __future__ import annotations

from functools import cache
from importlib import resources

import yaml


@cache
def architecture_profiles() -> dict[str, dict]:
    text = resources.files("trtc.configs").joinpath("architectures.yaml").read_text()
    return yaml.safe_load(text)


def quantization_format(method: str) -> str | None:
    """The hardware format a quantization method needs (None for unquantized)."""
    return {"none": None, "rtn": "int4", "awq": "int4", "gptq": "int4", "fp8": "fp8"}[method]
