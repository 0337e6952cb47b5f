"""Group-wise asymmetric round-to-nearest INT4: the baseline, and the quantizer AWQ and GPTQ
share.

For each output row ``n`` and group ``j`` of ``group_size`` consecutive input columns::

    lo, hi = min(w_group, 0), max(w_group, 0)     # the range always holds 0 (exact zeros)
    scale  = (hi - lo) / 15                       # 1 for an all-zero group
    zero   = round(-lo / scale)                   # in 0..15 because lo <= 0 <= hi
    q      = clamp(round(w / scale) + zero, 0, 15)
    w'     = (q - zero) * scale                   # = trtc::Int4Gemm's dequantization

Scales are returned in fp32; the artifact stores them in the model dtype (the Int4Gemm
contract), a relative change of at most 2^-11 for fp16.
"""
from __future__ import annotations

import torch

MAXQ = 15


def check_group_size(name: str, in_features: int, group_size: int) -> None:
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"{name}: in_features {in_features} is not a multiple of group_size "
                         f"{group_size}; choose a group_size that divides it")
    if in_features % 2:
        raise ValueError(f"{name}: in_features {in_features} is odd; INT4 packs two columns a byte")


def _range_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (hi - lo) / MAXQ
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, MAXQ)
    return scale, zero


def group_params(w: torch.Tensor, shrink_steps: int = 0, norm: float = 2.4
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., g]`` -> fp32 ``(scale [...], zero [...])`` of each row of ``g`` weights.

    ``shrink_steps > 0``: also try the range shrunk by 1%, 2%, ... (``shrink_steps`` of them)
    and keep, per row, the one with the least ``sum |w - w'|^norm`` (GPTQ's "mse" grid)."""
    w = w.float()
    lo = w.amin(-1).clamp(max=0.0)
    hi = w.amax(-1).clamp(min=0.0)
    scale, zero = _range_params(lo, hi)
    if shrink_steps:
        best = _error(w, scale, zero, norm)
        for i in range(1, shrink_steps + 1):
            s, z = _range_params(lo * (1 - i / 100), hi * (1 - i / 100))
            err = _error(w, s, z, norm)
            better = err < best
            best = torch.where(better, err, best)
            scale, zero = torch.where(better, s, scale), torch.where(better, z, zero)
    return scale, zero


def _error(w, scale, zero, norm):
    q = quantize_with(w, scale[..., None], zero[..., None])
    return ((q - zero[..., None]) * scale[..., None] - w).abs().pow(norm).sum(-1)


def quantize_with(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Round ``w`` to the grid ``(scale, zero)`` (broadcast): fp32 values 0..15."""
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, MAXQ)


def quantize_rtn(weight: torch.Tensor, group_size: int, name: str = "weight"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> ``(q uint8 [N, K] 0..15, scales fp32 [N, K/g], zeros uint8 [N, K/g])``."""
    n, k = weight.shape
    check_group_size(name, k, group_size)
    groups = weight.float().reshape(n, k // group_size, group_size)
    scale, zero = group_params(groups)
    q = quantize_with(groups, scale[..., None], zero[..., None])
    return q.reshape(n, k).to(torch.uint8), scale, zero.to(torch.uint8)


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """Unpacked ``q [N, K]`` back to fp32 weights (the Int4Gemm formula)."""
    scale = scales.float().repeat_interleave(group_size, dim=-1)
    zero = zeros.float().repeat_interleave(group_size, dim=-1)
    return (q.float() - zero) * scale


def fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """RTN round trip in fp32 (used inside the AWQ searches)."""
    return dequantize(*quantize_rtn(weight, group_size), group_size)
