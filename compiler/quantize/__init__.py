"""Weight quantization written from the papers: RTN (baseline), AWQ and GPTQ (INT4 W4A16,
group-wise asymmetric, for `trtc::Int4Gemm`), FP8 E4M3 (for `trtc::Fp8Gemm`); FP8 KV-cache
scales. One decoder layer at a time, from a `WeightSource`.

Entry points: `trtc.compiler.quantize.apply.quantize_source` (a build: weights read a tensor at
a time) and `quantize_model` (a transformers model in memory)."""

from trtc.compiler.quantize.apply import (
    METHODS,
    Fp8Weights,
    Int4Weights,
    QuantizationResult,
    quantize_model,
    quantize_source,
)

__all__ = [
    "METHODS",
    "Fp8Weights",
    "Int4Weights",
    "QuantizationResult",
    "quantize_model",
    "quantize_source",
]
