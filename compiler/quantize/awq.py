"""AWQ: activation-aware weight quantization (Lin et al., 2023), written from the paper.

A few input channels carry much larger activations than the rest; rounding errors on the
weights that multiply them cost the most. AWQ scales those weight columns up by
``s = mean|x| ** alpha`` before quantizing (so they are rounded relatively finer) and divides
the input by ``s``, folded into the op that produces it:

* q/k/v  read ``input_layernorm``          -> the RMSNorm weight is divided by s
* gate/up read ``post_attention_layernorm`` -> the RMSNorm weight is divided by s
* down   reads ``act(gate) * up``          -> up_proj's output rows (and bias) are divided by s
* o      reads the attention output, a mix of v_proj rows -> v_proj's rows are divided by s,
  only when the shapes match (no GQA: o_proj.in_features == v_proj.out_features)

so the floating point model computes the same function (up to rounding). ``alpha`` is chosen
per group from a 20-point grid on [0, 1] to minimise the mean squared error of the group's
outputs (its Linears' outputs, concatenated; for gate/up the MLP's output, through the
activation and down_proj, as in the paper's implementation) with quantized scaled weights
against the fp outputs, on calibration activations (a uniform sample of at most 4096 tokens,
see `ActivationSample`; ``mean|x|`` uses every token). ``alpha = 0`` is plain RTN, so on the
calibration sample AWQ never does worse than RTN.

Then, as in the paper, a clipping search: per output row and group, the weight range is
shrunk to ``max|w| * (1 - i/20)``, i = 0..9, keeping the ratio that best preserves that group's
contribution to the output on calibration tokens (skipped for q/k, whose errors the attention
softmax amplifies in ways a per-output error does not see). Clipping is applied only to the
copy that is quantized; the fp model keeps its unclipped (scaled) weights.

Finally the scaled, clipped weights are RTN-quantized (`rtn.quantize_rtn`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trtc.compiler.quantize import rtn
from trtc.compiler.quantize.layers import INPUT_GROUPS, linear
from trtc.plugins.int4_gemm.reference import per_column

N_GRID = 20  # alpha grid points on [0, 1]
CLIP_GRID = 20  # clipping ratios 1 - i/CLIP_GRID ...
CLIP_MAX_SHRINK = 0.5  # ... down to 1 - CLIP_MAX_SHRINK (exclusive)
SEARCH_TOKENS = 4096  # token rows sampled for the scale search ...
CLIP_TOKENS = 1024  # ... and, of those, for the clip search
SAMPLE_SEED = 0  # the sample's seed: builds stay reproducible
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")


class ActivationSample:
    """Per input channel mean |x| over every calibration token, plus a sample of at most
    ``max_tokens`` token rows for the searches, drawn uniformly without replacement (seeded:
    builds stay reproducible), so every position of a window is as likely to be in it.

    Not an even stride: calibration windows all have one length, and a stride that divides it
    takes the same positions of every window, position 0 among them, the attention sink, whose
    activations are far larger than the rest and would then dominate the searches' squared
    errors well beyond their share of the data (docs/quantization.md, "AWQ's search sample")."""

    def __init__(self, total_tokens: int, max_tokens: int, seed: int = SAMPLE_SEED):
        order = torch.randperm(total_tokens, generator=torch.Generator().manual_seed(seed))
        self.keep = order[:max_tokens].sort().values  # token rows sampled, in stream order
        self.abs_sum: torch.Tensor | None = None
        self.count = 0
        self.rows: list[torch.Tensor] = []
        self._offset = 0

    def add(self, x: torch.Tensor) -> None:
        s = x.abs().sum(0)
        self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        self.count += x.shape[0]
        bounds = torch.tensor([self._offset, self._offset + x.shape[0]])
        lo, hi = torch.searchsorted(self.keep, bounds).tolist()
        self.rows.append(x[(self.keep[lo:hi] - self._offset).to(x.device)].clone())
        self._offset += x.shape[0]

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / self.count

    @property
    def tokens(self) -> torch.Tensor:
        return torch.cat(self.rows)


@dataclass
class _Group:
    prev: nn.Module  # RMSNorm, or the Linear whose output rows feed the group
    prev_path: str  # its attribute path in the layer
    prev_is_linear: bool
    paths: tuple[str, ...]  # the Linears that read the input, to be scaled


def scale_groups(layer: nn.Module) -> list[_Group]:
    attn, mlp = layer.self_attn, layer.mlp
    groups = [_Group(layer.input_layernorm, "input_layernorm", False, INPUT_GROUPS[0])]
    if attn.v_proj.out_features == attn.o_proj.in_features:
        groups.append(_Group(attn.v_proj, "self_attn.v_proj", True, INPUT_GROUPS[1]))
    groups.append(
        _Group(layer.post_attention_layernorm, "post_attention_layernorm", False, INPUT_GROUPS[2])
    )
    groups.append(_Group(mlp.up_proj, "mlp.up_proj", True, INPUT_GROUPS[3]))
    return groups


def folded_norms(layer: nn.Module) -> dict[str, torch.Tensor]:
    """``{name in the layer: weight}`` of the RMSNorms `awq_layer` folds its scales into: the
    fp tensors it changes besides the quantized Linears' (whose biases the INT4 results
    carry)."""
    return {
        f"{g.prev_path}.weight": g.prev.weight for g in scale_groups(layer) if not g.prev_is_linear
    }


def search_scale(
    x: torch.Tensor,
    mean_abs: torch.Tensor,
    weights: list[torch.Tensor],
    group_size: int,
    output=None,
) -> tuple[torch.Tensor, float, float]:
    """Best ``s [K]`` for the Linears ``weights`` (each ``[N_i, K]``) reading tokens
    ``x [M, K]``. ``output(x, weights)`` is what must be preserved (default: the Linears'
    outputs, concatenated). Returns ``(s, alpha, loss)``; alpha 0 gives s = 1."""
    output = output or (lambda x, ws: x @ torch.cat(ws).T)
    weights = [w.float() for w in weights]
    ref = output(x, weights)
    best = (torch.ones_like(mean_abs), 0.0, math.inf)
    for alpha in torch.linspace(0, 1, N_GRID).tolist():
        s = mean_abs.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        w_q = [rtn.fake_quantize(w * s, group_size) / s for w in weights]
        loss = (output(x, w_q) - ref).pow(2).mean().item()
        if loss < best[2]:
            best = (s, alpha, loss)
    return best


def _mlp_output(mlp: nn.Module):
    """gate/up are judged by the MLP's output (through the activation and down_proj), as in
    the paper's implementation: that is what their errors cost."""

    def output(x, ws):
        gate_b, up_b = mlp.gate_proj.bias, mlp.up_proj.bias
        h = mlp.act_fn(F.linear(x, ws[0], gate_b)) * F.linear(x, ws[1], up_b)
        return F.linear(h, mlp.down_proj.weight.float(), mlp.down_proj.bias)

    return output


def search_clip(
    x: torch.Tensor, weight: torch.Tensor, group_size: int, rows_per_batch: int = 256
) -> torch.Tensor:
    """Per output row and group, the clipping bound ``[N, K/g]`` (a shrunk max|w|) that best
    keeps that group's contribution ``x_group @ w_group`` on tokens ``x [M, K]``."""
    # Zero columns pad a shorter last group: they add nothing to any product.
    x, weight = (
        rtn.pad_to_groups(x.float(), group_size),
        rtn.pad_to_groups(weight.float(), group_size),
    )
    n, k = weight.shape
    g = k // group_size
    xg = x.reshape(-1, g, group_size).transpose(0, 1)  # [G, M, gs]
    bounds = []
    for w in weight.split(rows_per_batch):
        wg = w.reshape(-1, g, group_size)  # [n, G, gs]
        org_max = wg.abs().amax(-1)  # [n, G]
        ref = xg @ wg.permute(1, 2, 0)  # [G, M, n]
        best_err = torch.full_like(org_max, math.inf)
        best_max = org_max.clone()
        for i in range(int(CLIP_MAX_SHRINK * CLIP_GRID)):
            max_val = org_max * (1 - i / CLIP_GRID)
            clipped = torch.maximum(torch.minimum(wg, max_val[..., None]), -max_val[..., None])
            w_q = rtn.fake_quantize(clipped.reshape(-1, k), group_size).reshape(wg.shape)
            err = (xg @ w_q.permute(1, 2, 0) - ref).pow(2).mean(1).T  # [n, G]
            better = err < best_err
            best_err[better], best_max[better] = err[better], max_val[better]
        bounds.append(best_max)
    return torch.cat(bounds)


def clip(weight: torch.Tensor, bounds: torch.Tensor, group_size: int) -> torch.Tensor:
    b = per_column(bounds, group_size, weight.shape[1])
    return torch.maximum(torch.minimum(weight.float(), b), -b)


def new_samples(num_tokens: int, max_tokens: int = SEARCH_TOKENS) -> dict[str, ActivationSample]:
    """An empty `ActivationSample` per input group, keyed by the group's first Linear (the
    input it reads), for a layer that sees ``num_tokens`` calibration tokens: fill them with the
    fp layer's inputs (`layers.input_hooks`), then call `awq_layer`."""
    return {paths[0]: ActivationSample(num_tokens, max_tokens) for paths in INPUT_GROUPS}


@torch.no_grad()
def awq_layer(
    layer: nn.Module,
    samples: dict[str, ActivationSample],
    group_size: int,
    *,
    max_clip_tokens: int = CLIP_TOKENS,
    clip_search: bool = True,
    partial_groups: bool = False,
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Scale-search, fold (in place, on the fp layer) and clip-search one decoder layer, from
    ``samples`` (`new_samples`) of the inputs the unchanged layer saw.
    Returns ``{path: (q uint8 [N, K], scales fp32, zeros uint8)}`` for its seven Linears."""
    # 1. Scales, all searched on the fp layer's own activations, then folded.
    for group in scale_groups(layer):
        sample = samples[group.paths[0]]
        weights = [linear(layer, p).weight for p in group.paths]
        output = _mlp_output(layer.mlp) if group.paths == INPUT_GROUPS[2] else None
        s, _, _ = search_scale(sample.tokens, sample.mean_abs, weights, group_size, output)
        _fold(group, [linear(layer, p) for p in group.paths], s)
        sample.rows = [r / s for r in sample.rows]  # the input the layer now sees

    # 2. Clipping, on the scaled weights and inputs; 3. RTN.
    result = {}
    for paths in INPUT_GROUPS:
        x = samples[paths[0]].tokens
        x = x[:: max(1, math.ceil(x.shape[0] / max_clip_tokens))]
        for path in paths:
            w = linear(layer, path).weight.float()
            if clip_search and path not in NO_CLIP:
                w = clip(w, search_clip(x, w, group_size), group_size)
            result[path] = rtn.quantize_rtn(w, group_size, path, partial_groups=partial_groups)
    return result


def _fold(group: _Group, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """x -> x / s in the producing op, W -> W * s in the consumers: the same function."""
    prev = group.prev
    if group.prev_is_linear:
        prev.weight.div_(s[:, None].to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    else:
        prev.weight.div_(s.to(prev.weight.dtype))
    for lin in linears:
        lin.weight.mul_(s[None, :].to(lin.weight.dtype))
