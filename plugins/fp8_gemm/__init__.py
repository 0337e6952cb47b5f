"""The `trtc::Fp8Gemm` plugin: its ONNX signature, the torch entry point and a Linear module
that calls it."""

from __future__ import annotations

import torch
from torch import nn

from trtc.plugins.fp8_gemm.reference import E4M3_MAX, to_fp8
from trtc.plugins.fp8_gemm.reference import fp8_gemm as reference
from trtc.plugins.spec import gemm_spec

SPEC = gemm_spec(
    "Fp8Gemm",
    weights=("weight", "weight_scale", "input_scale"),
    attributes={},
    doc="FP8 E4M3 GEMM: y = (fp8(x / input_scale) * input_scale) @ (weight * "
    "weight_scale[:, None]).T + bias in fp32, returned in x's dtype; fp8() saturates to "
    "+-448; weight float8_e4m3fn [N, K]; weight_scale fp32 [N] (per output channel); "
    "input_scale fp32 [] (per tensor, static); bias [N] optional (omitted when absent)",
)


def fp8_gemm(
    x, weight, weight_scale, input_scale, bias=None, *, in_features: int, out_features: int
) -> torch.Tensor:
    """Under ONNX export: one plugin node (without ``bias`` if None). Eager: `cuda.fp8_gemm`
    on CUDA tensors (``torch._scaled_mm`` where the GPU has FP8), the reference otherwise."""
    attrs = dict(in_features=in_features, out_features=out_features)
    inputs = (x, weight, weight_scale, input_scale, bias)
    if torch.onnx.is_in_onnx_export():
        return SPEC.export(inputs, attrs, (x.dtype, (*x.shape[:-1], out_features)))
    if x.is_cuda:
        from trtc.plugins.fp8_gemm.cuda import fp8_gemm as on_gpu

        return on_gpu(*inputs, **attrs)
    return reference(*inputs, **attrs)


class Fp8Linear(nn.Module):
    """A Linear whose weight and input are FP8 (`trtc::Fp8Gemm`). ``weight`` (E4M3) and the two
    fp32 scales keep their dtypes under ``.to(dtype)``; ``bias`` follows the model dtype."""

    _fixed_dtype = ("weight", "weight_scale", "input_scale")

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor | None,
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("bias", bias)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) would turn the E4M3 weight (a floating point dtype) into fp16.
        kept = {k: self._buffers[k] for k in self._fixed_dtype}
        super()._apply(fn, recurse)
        for k, old in kept.items():
            self._buffers[k] = old.to(self._buffers[k].device)
        return self

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``x @ W.T + bias``; ``add_bias=False`` leaves the bias out (a row-parallel rank's
        partial product, whose bias is added once after the sum over ranks)."""
        weights = self.weight, self.weight_scale, self.input_scale
        bias = None if self.bias is None or not add_bias else self.bias.to(x.dtype)
        return fp8_gemm(
            x, *weights, bias, in_features=self.in_features, out_features=self.out_features
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


__all__ = ["E4M3_MAX", "SPEC", "Fp8Linear", "fp8_gemm", "to_fp8"]
