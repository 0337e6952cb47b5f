"""Weight quantization written from the papers: RTN (baseline), AWQ and GPTQ (INT4 W4A16,
group-wise asymmetric, for `trtc::Int4Gemm`), FP8 E4M3 (for `trtc::Fp8Gemm`).

Entry point: `trtc.compiler.quantize.apply.quantize_model`."""

from trtc.compiler.quantize.apply import (
    METHODS,
    Fp8Weights,
    Int4Weights,
    QuantizationResult,
    quantize_model,
)

__all__ = ["METHODS", "Fp8Weights", "Int4Weights", "QuantizationResult", "quantize_model"]
