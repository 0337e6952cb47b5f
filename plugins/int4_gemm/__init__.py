"""The `trtc::Int4Gemm` plugin: its ONNX signature, the torch entry point and a Linear module
that calls it."""

from __future__ import annotations

import torch
from torch import nn

from trtc.plugins.int4_gemm.reference import check_shapes, dequantize, pack_int4, unpack_int4
from trtc.plugins.int4_gemm.reference import int4_gemm as reference
from trtc.plugins.spec import gemm_spec

SPEC = gemm_spec(
    "Int4Gemm",
    weights=("qweight", "scales", "zeros"),
    attributes={"group_size": int},
    doc="W4A16 group-wise asymmetric GEMM: y = x @ ((q - zeros) * scales).T + bias in fp32, "
    "returned in x's dtype; qweight uint8 [N, K/2] holds two 4-bit values per byte along K, "
    "low nibble = even k (the ONNX UINT4 [N, K] layout); scales [N, ceil(K/group)] in x's "
    "dtype; zeros uint8 [N, ceil(K/group)] (a row's last group is shorter when group does not "
    "divide K); bias [N] optional (omitted from the node when absent)",
)


def int4_gemm(
    x, qweight, scales, zeros, bias=None, *, group_size: int, in_features: int, out_features: int
) -> torch.Tensor:
    """Under ONNX export: one plugin node (without ``bias`` if None). Eager: the Triton kernels
    on CUDA tensors (group sizes they take), the torch reference otherwise."""
    attrs = dict(group_size=group_size, in_features=in_features, out_features=out_features)
    inputs = (x, qweight, scales, zeros, bias)
    if torch.onnx.is_in_onnx_export():
        return SPEC.export(inputs, attrs, (x.dtype, (*x.shape[:-1], out_features)))
    if x.is_cuda:
        from trtc.plugins.int4_gemm import triton_kernels

        if triton_kernels.supports(group_size):
            check_shapes(*inputs, **attrs)
            return triton_kernels.int4_gemm(*inputs, **attrs)
    return reference(*inputs, **attrs)


class Int4Linear(nn.Module):
    """A Linear whose weight is INT4 (`trtc::Int4Gemm`). Buffers: ``qweight`` and ``zeros``
    (uint8, untouched by ``.to(dtype)``), ``scales`` and ``bias`` (follow the model dtype)."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int,
    ):
        super().__init__()
        self.out_features, self.in_features = qweight.shape[0], qweight.shape[1] * 2
        self.group_size = group_size
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``x @ W.T + bias``; ``add_bias=False`` leaves the bias out (a row-parallel rank's
        partial product, whose bias is added once after the sum over ranks)."""
        weights = self.qweight, self.scales.to(x.dtype), self.zeros
        bias = None if self.bias is None or not add_bias else self.bias.to(x.dtype)
        return int4_gemm(
            x,
            *weights,
            bias,
            group_size=self.group_size,
            in_features=self.in_features,
            out_features=self.out_features,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={self.bias is not None}"
        )


__all__ = ["SPEC", "Int4Linear", "dequantize", "int4_gemm", "pack_int4", "unpack_int4"]
