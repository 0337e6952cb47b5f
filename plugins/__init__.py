"""trtc plugins: one semantic definition (a torch reference) per custom ONNX op, plus the
implementations that must agree with it."""

from trtc.plugins.all_reduce import SPEC as ALL_REDUCE
from trtc.plugins.fp8_gemm import SPEC as FP8_GEMM
from trtc.plugins.int4_gemm import SPEC as INT4_GEMM
from trtc.plugins.paged_attention import SPEC as PAGED_ATTENTION
from trtc.plugins.spec import DOMAIN, PluginSpec

PLUGINS: dict[str, PluginSpec] = {
    s.op_type: s for s in (PAGED_ATTENTION, INT4_GEMM, FP8_GEMM, ALL_REDUCE)
}

__all__ = [
    "DOMAIN",
    "PLUGINS",
    "PAGED_ATTENTION",
    "INT4_GEMM",
    "FP8_GEMM",
    "ALL_REDUCE",
    "PluginSpec",
]
