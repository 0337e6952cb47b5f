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

With ``partial_groups`` a ``group_size`` that does not divide K is allowed: the last group of
each row holds the ``K % group_size`` remaining columns (the Int4Gemm rule). The searches here
work on rows zero-padded to whole groups (`pad_to_groups`): a zero weight changes neither a
group's range (which always holds 0) nor, quantized exactly to the zero point, any error sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtc.plugins.int4_gemm.reference import dequantize_unpacked, num_groups

MAXQ = 15


def check_group_size(
    name: str, in_features: int, group_size: int, partial_groups: bool = False
) -> None:
    if group_size <= 0 or (in_features % group_size and not partial_groups):
        raise ValueError(
            f"{name}: in_features {in_features} is not a multiple of group_size "
            f"{group_size}; choose a group_size that divides it, or allow a shorter "
            f"last group (partial_groups)"
        )
    if in_features % 2:
        raise ValueError(f"{name}: in_features {in_features} is odd; INT4 packs two columns a byte")


def pad_to_groups(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[..., K]`` -> ``[..., G * group_size]``, zero columns appended (none when g divides K)."""
    k = t.shape[-1]
    return F.pad(t, (0, num_groups(k, group_size) * group_size - k))


def _range_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (hi - lo) / MAXQ
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, MAXQ)
    return scale, zero


def group_params(
    w: torch.Tensor,
    shrink_steps: int = 0,
    norm: float = 2.4,
    column_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., g]`` -> fp32 ``(scale [...], zero [...])`` of each row of ``g`` weights.

    ``shrink_steps > 0``: also try the range shrunk by 1%, 2%, ... (``shrink_steps`` of them)
    and keep, per row, the one with the least error: ``sum |w - w'|^norm`` (GPTQ's reference
    "mse" grid), or with ``column_weights`` (broadcast against ``w``, e.g. ``[G, g]``) the
    weighted squared error ``sum c * (w - w')^2``."""
    w = w.float()
    lo = w.amin(-1).clamp(max=0.0)
    hi = w.amax(-1).clamp(min=0.0)
    scale, zero = _range_params(lo, hi)
    if shrink_steps:
        best = _error(w, scale, zero, norm, column_weights)
        for i in range(1, shrink_steps + 1):
            s, z = _range_params(lo * (1 - i / 100), hi * (1 - i / 100))
            err = _error(w, s, z, norm, column_weights)
            better = err < best
            best = torch.where(better, err, best)
            scale, zero = torch.where(better, s, scale), torch.where(better, z, zero)
    return scale, zero


def _error(w, scale, zero, norm, column_weights):
    q = quantize_with(w, scale[..., None], zero[..., None])
    diff = (q - zero[..., None]) * scale[..., None] - w
    if column_weights is not None:
        return (diff.square() * column_weights).sum(-1)
    return diff.abs().pow(norm).sum(-1)


def quantize_with(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Round ``w`` to the grid ``(scale, zero)`` (broadcast): fp32 values 0..15."""
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, MAXQ)


def quantize_rtn(
    weight: torch.Tensor, group_size: int, name: str = "weight", *, partial_groups: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> ``(q uint8 [N, K] 0..15, scales fp32 [N, G], zeros uint8 [N, G])``,
    ``G = ceil(K / group_size)``."""
    n, k = weight.shape
    check_group_size(name, k, group_size, partial_groups)
    groups = pad_to_groups(weight.float(), group_size).reshape(n, -1, group_size)
    scale, zero = group_params(groups)
    q = quantize_with(groups, scale[..., None], zero[..., None])
    return q.reshape(n, -1)[:, :k].to(torch.uint8), scale, zero.to(torch.uint8)


# Unpacked ``q [N, K]`` back to fp32 weights: the Int4Gemm formula, from its one definition.
dequantize = dequantize_unpacked


def fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """RTN round trip in fp32 (used inside the AWQ searches; any K)."""
    return dequantize(*quantize_rtn(weight, group_size, partial_groups=True), group_size)
