"""GPTQ (Frantar et al., 2022), written from the paper.

For a Linear with weight ``W [N, K]`` and calibration inputs ``X [M, K]``, GPTQ minimises
``||W X^T - Q X^T||^2`` one input column at a time: after rounding column ``j`` it spreads the
rounding error over the columns not yet quantized through the inverse Hessian
``H^-1``, ``H = 2 X^T X / M`` (Optimal Brain Quantization, with the paper's three speed-ups):

* a fixed column order for all rows, so ``H^-1`` is shared;
* lazy batch updates: columns are processed in blocks of 128; the error of a block reaches the
  columns after it in one matrix product;
* the Cholesky form: the rows of the upper Cholesky factor of ``H^-1`` are exactly the
  coefficients the sequential updates need, computed once and stable.

``H`` is dampened by ``percdamp * mean(diag(H))`` (0.01 by default) on its diagonal; inputs
that are always zero ("dead" columns) get ``H_jj = 1`` and a zero weight.

Group-wise scales/zeros: without act-order they are computed when the quantizer reaches the
first column of a group, from that group's weights as updated so far (so the error
compensation of earlier groups is taken into account).

Act-order (``act_order=True``, the default) processes columns in decreasing ``diag(H)``
(most "active" first, so their error can still be compensated by the many columns after
them). To keep the plain group layout of `trtc::Int4Gemm` (column k uses group k // g, no
g_idx permutation table, no runtime cost), groups are *static*: every group's scale/zero is
computed up front from the unmodified weights, and each column is rounded with its own
group's parameters whatever order it is reached in. The packed result is in the original
column order.

Range search (``shrink_steps=SHRINK_STEPS``, 79: the reference implementation's range, shrunk
by up to 79% on a 1% grid): each group's range ``[min, max]`` is also tried shrunk by 1%..79%;
trading a few clipped outliers for a finer grid is worth it at 4 bits. A candidate is judged
by the squared error weighted by the Hessian's diagonal, ``sum_j H_jj (w_j - w'_j)^2``: the
diagonal of GPTQ's own objective ``tr(E H E^T)`` (``E = W - Q``), so a group's range is not
spent on a weight whose input is small. With static groups the ranges are fixed before any
compensation, from these errors alone, so how candidates are judged matters; the reference
implementation's unweighted ``sum |w - w'|^2.4`` is compared in docs/quantization.md ("GPTQ's
range search").

The same error feedback also serves FP8 weights (`gptq_fp8`): the grid is E4M3 with the
per-channel scale, the loop is unchanged (damping 0.1 there, see its docstring).

`gptq_layer` runs it in the usual sequential way: decoder layer by decoder layer, and inside
a layer Linear group by Linear group (q/k/v, o, gate/up, down), each one calibrated on the
inputs produced by the already-quantized Linears and layers before it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from trtc.compiler.quantize import rtn
from trtc.compiler.quantize.layers import (
    INPUT_GROUPS,
    LayerInputs,
    capture_inputs,
    linear,
    run_layer,
)

BLOCK_SIZE = 128
SHRINK_STEPS = 79


class Hessian:
    """Running ``H = 2 X^T X / M`` over calibration batches."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.h = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.float()
        self.h.addmm_(x.T, x)
        self.count += x.shape[0]

    @property
    def value(self) -> torch.Tensor:
        return self.h * (2.0 / max(self.count, 1))

    def take(self) -> torch.Tensor:
        """`value`, computed in the accumulator's memory (which this object then gives up):
        one ``K x K`` matrix less."""
        h, self.h = self.h, None
        return h.mul_(2.0 / max(self.count, 1))


def _upper_cholesky_inverse(damped: Callable[[float], torch.Tensor], damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp I)^-1``, ``damped(d)`` giving a new ``H + d I``;
    more damping if H is not positive definite. Besides H, two ``K x K`` matrices at most are
    alive at once (the damped H and its factor, the factor and the inverse, the inverse and its
    factor): at K = 14336 (an 8B model's down_proj) each is 822 MB."""
    for attempt in range(6):
        lower, info = torch.linalg.cholesky_ex(damped(damp * (10**attempt)))
        if info == 0:
            hinv = torch.cholesky_inverse(lower)
            del lower
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if info == 0:
                return u
    raise RuntimeError(
        "GPTQ: the Hessian stays singular after damping (calibration data too small or degenerate?)"
    )


def _prepare(weight: torch.Tensor, hessian: torch.Tensor, act_order: bool, percdamp: float):
    """Dead columns, column order, damping: ``(wt fp32 [K, N], perm, upper Cholesky of H^-1)``
    with the weight transposed (a column a row, see `_error_feedback`), it and the factor in
    processing order. ``hessian`` is left as it is."""
    w = weight.detach().float().clone()
    diag = torch.diag(hessian).float()
    dead = diag == 0
    diag[dead] = 1.0  # H_jj = 1 for a dead column (its weight is 0)
    w[:, dead] = 0.0
    if act_order:
        perm = torch.argsort(diag, descending=True, stable=True)
    else:
        perm = torch.arange(w.shape[1], device=w.device)
    w = w[:, perm]
    dead = dead[perm]

    def damped(d: float) -> torch.Tensor:
        # The permuted H in one gather, dead columns' H_jj = 1, then + d I on the diagonal.
        h = hessian.float()[perm[:, None], perm[None, :]]
        h.add_(0.0)  # x + 0.0 is x but for -0.0, as when d I is added as a matrix
        diagonal = h.diagonal()
        diagonal[dead] = 1.0
        diagonal.add_(d)
        return h

    damp = percdamp * torch.mean(diag[perm]).item()
    return w.T.contiguous(), perm, _upper_cholesky_inverse(damped, damp)


def _error_feedback(
    wt: torch.Tensor,
    hinv: torch.Tensor,
    block_size: int,
    round_column: Callable[[int, int, torch.Tensor], torch.Tensor],
) -> None:
    """The GPTQ loop over columns (processing order), on the weight transposed: ``wt [K, N]``
    holds column ``j`` of the weight as row ``j``, so that each of the loop's steps reads and
    updates contiguous rows (about twice as fast on a CPU as strided columns, the same
    arithmetic). ``round_column(col, i, blk)`` returns the dequantized column ``col`` (=
    ``blk[i]`` rounded, ``blk`` the block's rows) and records what it chose; its rounding
    error is spread over the later columns through ``hinv``."""
    k = wt.shape[0]
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        blk = wt[b0:b1].clone()
        err_blk = torch.zeros_like(blk)
        hinv_blk = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            err = (blk[i] - round_column(b0 + i, i, blk)) / hinv_blk[i, i]
            blk[i:] -= hinv_blk[i, i:, None] * err[None, :]
            err_blk[i] = err
        wt[b1:] -= hinv[b0:b1, b1:].T @ err_blk


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    *,
    percdamp: float = 0.01,
    act_order: bool = True,
    shrink_steps: int = SHRINK_STEPS,
    block_size: int = BLOCK_SIZE,
    name: str = "weight",
    partial_groups: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]``, ``hessian [K, K]`` -> ``(q uint8 [N, K], scales fp32 [N, G],
    zeros uint8 [N, G])`` in the plain group layout, original column order,
    ``G = ceil(K / group_size)`` (a shorter last group with ``partial_groups``).

    ``shrink_steps``: the range search of each group's scale/zero (`rtn.group_params`, the
    candidates judged by their error weighted by ``diag(H)``)."""
    n, k = weight.shape
    rtn.check_group_size(name, k, group_size, partial_groups)
    if block_size % group_size:
        raise ValueError(
            f"GPTQ block size {block_size} is not a multiple of group_size {group_size}"
        )
    num_groups = -(-k // group_size)
    diag = torch.diag(hessian).float()
    # diag(H) per column, padded like the weights: the range search's column weights.
    h_diag = rtn.pad_to_groups(diag, group_size).reshape(num_groups, group_size)
    scales = torch.zeros(n, num_groups, device=weight.device)
    zeros = torch.zeros(n, num_groups, device=weight.device)
    if act_order:  # static groups, from the unmodified weights
        w0 = weight.detach().float().clone()
        w0[:, diag == 0] = 0.0
        w0 = rtn.pad_to_groups(w0, group_size)
        scales[:], zeros[:] = rtn.group_params(
            w0.reshape(n, num_groups, group_size), shrink_steps, column_weights=h_diag
        )
        del w0
    wt, perm, hinv = _prepare(weight, hessian, act_order, percdamp)
    group_of = (perm // group_size).tolist()  # group of each processed column
    qt = torch.zeros(k, n, device=weight.device)  # transposed, as wt

    def round_column(col: int, i: int, blk: torch.Tensor) -> torch.Tensor:
        g = group_of[col]
        if not act_order and col % group_size == 0:
            # In plain order a group starts here and lies inside this block (g | block size).
            cols = blk[i : i + group_size].T  # fewer in a shorter last group
            scales[:, g], zeros[:, g] = rtn.group_params(
                cols, shrink_steps, column_weights=h_diag[g, : cols.shape[1]]
            )
        qt[col] = rtn.quantize_with(blk[i], scales[:, g], zeros[:, g])
        return (qt[col] - zeros[:, g]) * scales[:, g]

    _error_feedback(wt, hinv, block_size, round_column)
    q = qt.T[:, torch.argsort(perm)]
    return q.to(torch.uint8), scales, zeros.to(torch.uint8)


@torch.no_grad()
def gptq_fp8(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    percdamp: float = 0.1,
    act_order: bool = True,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's error feedback onto the FP8 E4M3 grid: the per-channel scales of
    `fp8.quantize_weight_fp8` (max |w| / 448, from the unmodified weights), each weight rounded
    to E4M3 in turn with the error spread over the columns not yet rounded.
    Returns ``(float8_e4m3fn [N, K], weight_scale fp32 [N])``.

    Damping is 10x INT4's (0.1): the E4M3 grid is fine enough that, with INT4's damping, the
    compensation fits the calibration text's correlations and carries less over to other text
    (docs/quantization.md, "FP8 weights: error-feedback damping")."""
    from trtc.compiler.quantize.fp8 import quantize_weight_fp8
    from trtc.plugins.fp8_gemm.reference import to_fp8

    _, scale = quantize_weight_fp8(weight)
    wt, perm, hinv = _prepare(weight, hessian, act_order, percdamp)
    # E4M3 values, held in fp32 (exact) while filling; transposed, as wt
    out = torch.zeros(wt.shape, device=wt.device)

    def round_column(col: int, i: int, blk: torch.Tensor) -> torch.Tensor:
        out[col] = to_fp8(blk[i] / scale).float()
        return out[col] * scale

    _error_feedback(wt, hinv, block_size, round_column)
    return out.T[:, torch.argsort(perm)].to(torch.float8_e4m3fn), scale


@torch.no_grad()
def gptq_layer(
    layer: nn.Module,
    inputs: LayerInputs,
    quantize: Callable[[str, torch.Tensor, torch.Tensor], tuple[tuple, torch.Tensor]],
) -> dict[str, tuple]:
    """Quantize one decoder layer's seven Linears sequentially with
    ``quantize(path, weight, hessian) -> (quantized tensors, dequantized weight)``.
    Returns ``{path: quantized tensors}``. The layer is left holding the dequantized weights,
    and ``inputs`` advanced through it (`run_layer`): the next layer's calibration inputs,
    computed with this layer's quantized weights."""
    result = {}
    for paths in INPUT_GROUPS:
        first = linear(layer, paths[0])
        hessian = Hessian(first.in_features, first.weight.device)
        capture_inputs(layer, inputs, paths[:1], lambda _, x, acc=hessian: acc.add(x))
        h = hessian.take()
        for path in paths:
            lin = linear(layer, path)
            result[path], dequantized = quantize(path, lin.weight, h)
            # Later groups (and the next layer) calibrate on the quantized function.
            lin.weight.copy_(dequantized)
    run_layer(layer, inputs)
    return result


def int4_quantizer(group_size: int, **options):
    """`gptq_layer`'s ``quantize`` for INT4 (options: those of `gptq_quantize`)."""

    def quantize(path, weight, hessian):
        q, scales, zeros = gptq_quantize(weight, hessian, group_size, name=path, **options)
        return (q, scales, zeros), rtn.dequantize(q, scales, zeros, group_size)

    return quantize


def fp8_quantizer(**options):
    """`gptq_layer`'s ``quantize`` for FP8 weights (options: those of `gptq_fp8`)."""

    def quantize(path, weight, hessian):
        w8, scale = gptq_fp8(weight, hessian, **options)
        return (w8, scale), w8.float() * scale[:, None]

    return quantize
