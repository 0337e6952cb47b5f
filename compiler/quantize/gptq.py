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

Group-wise scales/zeros (`rtn.group_params`) are computed when the quantizer reaches the
first column of a group, from that group's weights as updated so far, so the error
compensation of earlier groups is taken into account.

Act-order (``act_order=True``) processes columns in decreasing ``diag(H)`` (most "active"
first). To keep the plain group layout of `trtc::Int4Gemm` (column k uses group k // g, no
g_idx permutation table), groups are *static*: every group's scale/zero is computed up front
from the unmodified weights, and each column is rounded with its own group's parameters
whatever order it is reached in. The packed result is in the original column order.

`gptq_layer` runs it in the usual sequential way: decoder layer by decoder layer, and inside
a layer Linear group by Linear group (q/k/v, o, gate/up, down), each one calibrated on the
inputs produced by the already-quantized Linears and layers before it.
"""
from __future__ import annotations

import torch

from torch import nn

from trtc.compiler.quantize import rtn
from trtc.compiler.quantize.layers import INPUT_GROUPS, LINEARS, LayerInputs, capture_inputs, linear, run_layer

BLOCK_SIZE = 128


class Hessian:
    """Running ``H = 2 X^T X / M`` over calibration batches."""

    def __init__(self, in_features: int):
        self.h = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.float()
        self.h.addmm_(x.T, x)
        self.count += x.shape[0]

    @property
    def value(self) -> torch.Tensor:
        return self.h * (2.0 / max(self.count, 1))


def _upper_cholesky_inverse(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp I)^-1``; more damping if H is not positive definite."""
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    for attempt in range(6):
        l, info = torch.linalg.cholesky_ex(h + damp * (10 ** attempt) * eye)
        if info == 0:
            hinv = torch.cholesky_inverse(l)
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if info == 0:
                return u
    raise RuntimeError("GPTQ: the Hessian stays singular after damping (calibration data "
                       "too small or degenerate?)")


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, *,
                  percdamp: float = 0.01, act_order: bool = False, block_size: int = BLOCK_SIZE,
                  shrink_steps: int = 0, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]``, ``hessian [K, K]`` -> ``(q uint8 [N, K], scales fp32 [N, K/g],
    zeros uint8 [N, K/g])`` in the plain group layout, original column order."""
    n, k = weight.shape
    rtn.check_group_size(name, k, group_size)
    if block_size % group_size:
        raise ValueError(f"GPTQ block size {block_size} is not a multiple of group_size {group_size}")
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    num_groups = k // group_size
    scales = torch.zeros(n, num_groups)
    zeros = torch.zeros(n, num_groups)
    if act_order:
        s, z = rtn.group_params(w.reshape(n, num_groups, group_size), shrink_steps)
        scales[:], zeros[:] = s, z
        perm = torch.argsort(torch.diag(h), descending=True, stable=True)
    else:
        perm = torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    group_of = perm // group_size                       # group of each processed column

    damp = percdamp * torch.mean(torch.diag(h)).item()
    hinv = _upper_cholesky_inverse(h, damp)

    q = torch.zeros(n, k)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        w_blk = w[:, b0:b1].clone()
        err_blk = torch.zeros_like(w_blk)
        hinv_blk = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            g = group_of[col].item()
            if not act_order and col % group_size == 0:
                # Both orders are the identity here; a group lies inside one block.
                s, z = rtn.group_params(w_blk[:, i:i + group_size], shrink_steps)
                scales[:, g], zeros[:, g] = s, z
            column = w_blk[:, i]
            qc = rtn.quantize_with(column, scales[:, g], zeros[:, g])
            q[:, col] = qc
            err = (column - (qc - zeros[:, g]) * scales[:, g]) / hinv_blk[i, i]
            w_blk[:, i:] -= err[:, None] * hinv_blk[i, i:][None, :]
            err_blk[:, i] = err
        w[:, b1:] -= err_blk @ hinv[b0:b1, b1:]

    q = q[:, torch.argsort(perm)]
    return q.to(torch.uint8), scales, zeros.to(torch.uint8)


@torch.no_grad()
def gptq_layer(layer: nn.Module, inputs: LayerInputs, group_size: int, *,
               percdamp: float = 0.01, act_order: bool = False, shrink_steps: int = 0
               ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Quantize one decoder layer's seven Linears sequentially. Returns ``({path: (q, scales,
    zeros)}, the layer's outputs computed with its quantized weights)``: the next layer's
    calibration inputs. The layer's fp weights are restored before returning."""
    originals = {p: linear(layer, p).weight.detach().clone() for p in LINEARS}
    result = {}
    try:
        for paths in INPUT_GROUPS:
            hessian = Hessian(linear(layer, paths[0]).in_features)
            capture_inputs(layer, inputs, paths[:1], lambda _, x: hessian.add(x))
            h = hessian.value
            for path in paths:
                lin = linear(layer, path)
                q, scales, zeros = gptq_quantize(lin.weight, h, group_size, percdamp=percdamp,
                                                 act_order=act_order, shrink_steps=shrink_steps,
                                                 name=path)
                result[path] = (q, scales, zeros)
                # Later groups (and the next layer) calibrate on the quantized function.
                lin.weight.copy_(rtn.dequantize(q, scales, zeros, group_size))
        outputs = run_layer(layer, inputs)
    finally:
        for p, w in originals.items():
            linear(layer, p).weight.copy_(w)
    return result, outputs
