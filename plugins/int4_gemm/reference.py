"""`trtc::Int4Gemm` — the semantic definition (torch, CPU).

W4A16 group-wise asymmetric weight-only GEMM. Every other implementation (Triton kernels, the
TensorRT plugin, the TensorRT-RTX DequantizeLinear lowering) is tested against `int4_gemm`.

Inputs

* ``x``: ``[T, K]`` activations, fp16, bf16 or fp32 (any leading dims are accepted here and
  flattened; the ONNX node sees ``[T, K]``).
* ``qweight``: uint8 ``[N, K/2]``. The 4-bit weight ``q[n, k]`` (0..15) of output row ``n`` and
  input column ``k`` lives in byte ``qweight[n, k // 2]``: the LOW nibble holds the even ``k``,
  the HIGH nibble the odd ``k``. This is byte for byte the layout of an ONNX ``UINT4`` tensor
  of shape ``[N, K]`` (row-major, first element in the low nibble), so a DequantizeLinear
  lowering reuses these bytes unchanged.
* ``scales``: ``[N, G]``, in x's dtype, ``G = ceil(K / group_size)``.
* ``zeros``: uint8 ``[N, G]``, one zero point (0..15) per byte, not packed.
* ``bias``: optional ``[N]`` (absent from the node when the layer has none).

Attributes ``group_size`` (32, 64 or 128 in practice), ``in_features`` (K, even),
``out_features`` (N). When ``group_size`` does not divide K, the last group of each row is
shorter (``K % group_size`` columns), the rule of ONNX's blocked DequantizeLinear.

Semantics, computed in fp32 and returned in x's dtype::

    g = group_size
    W[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g]
    y = x @ W.T + bias                      # y: [T, N]

Groups run along K (the reduction axis) within one output row, as in AWQ and GPTQ.
"""

from __future__ import annotations

import torch


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` values 0..15 -> uint8 ``[N, K/2]``, even k in the low nibble."""
    if q.dtype != torch.uint8:
        raise TypeError(f"pack_int4 wants uint8 values 0..15, got {q.dtype}")
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4: the last dimension ({q.shape[-1]}) must be even")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"pack_int4: value {int(q.max())} does not fit in 4 bits")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> uint8 ``[N, K]`` values 0..15 (inverse of `pack_int4`)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4 wants uint8, got {packed.dtype}")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def num_groups(in_features: int, group_size: int) -> int:
    """Groups per row: ``ceil(K / group_size)`` (the last one may be shorter)."""
    return -(-in_features // group_size)


def per_column(groups: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """``[..., G]`` per-group values -> ``[..., K]``: column k takes group ``k // group_size``."""
    return groups.repeat_interleave(group_size, dim=-1)[..., :in_features]


def dequantize_unpacked(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """fp32 ``W [N, K]`` from unpacked values ``q [N, K]`` (0..15) and their groups' scales and
    zeros."""
    k = q.shape[-1]
    return (q.float() - per_column(zeros.float(), group_size, k)) * per_column(
        scales.float(), group_size, k
    )


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The fp32 weight ``W [N, K]`` that the packed tensors stand for."""
    return dequantize_unpacked(unpack_int4(qweight), scales, zeros, group_size)


def check_shapes(
    x, qweight, scales, zeros, bias, group_size: int, in_features: int, out_features: int
) -> None:
    k, n = in_features, out_features
    if k % 2 or group_size <= 0:
        raise ValueError(
            f"Int4Gemm: in_features {k} must be even and group_size {group_size} positive"
        )
    g = num_groups(k, group_size)
    expected = {
        "x": (x, (k,)),
        "qweight": (qweight, (n, k // 2)),
        "scales": (scales, (n, g)),
        "zeros": (zeros, (n, g)),
    }
    if bias is not None:
        expected["bias"] = (bias, (n,))
    for name, (t, shape) in expected.items():
        got = tuple(t.shape[-1:]) if name == "x" else tuple(t.shape)
        if got != shape:
            raise ValueError(
                f"Int4Gemm: {name} has shape {tuple(t.shape)}, expected "
                f"{'[..., ' + str(k) + ']' if name == 'x' else list(shape)}"
            )
    if qweight.dtype != torch.uint8 or zeros.dtype != torch.uint8:
        raise TypeError(
            f"Int4Gemm: qweight and zeros must be uint8, got {qweight.dtype}, {zeros.dtype}"
        )


def int4_gemm(
    x, qweight, scales, zeros, bias=None, *, group_size: int, in_features: int, out_features: int
) -> torch.Tensor:
    """``y [T, N] = x @ dequantize(W).T + bias`` in fp32, returned in x's dtype."""
    check_shapes(x, qweight, scales, zeros, bias, group_size, in_features, out_features)
    w = dequantize(qweight, scales, zeros, group_size)
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
