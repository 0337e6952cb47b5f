"""Scales of an FP8 (E4M3) KV cache, calibrated on text.

The cache stores ``fp8(k / k_scale)`` and ``fp8(v / v_scale)`` with one static scale per layer
for keys and one for values (the `trtc::PagedAttention` contract). Here::

    k_scale = HEADROOM * amax_k / 448,   v_scale = HEADROOM * amax_v / 448

``amax_v`` is the largest |v_proj output| over the calibration tokens. Keys are cached after the
rotary embedding, which turns each pair ``(x_i, x_{i + D/2})`` of a head by an angle: no rotated
value exceeds the pair's norm, so ``amax_k`` is the largest such norm of the k_proj output, a
bound that holds at every position, not only the calibrated ones. ``HEADROOM`` (2) leaves room for
activations larger than any the calibration text produced before they saturate; E4M3 keeps the
same relative precision (3 mantissa bits) over its whole normal range, so the headroom costs
only the smallest values.
"""

from __future__ import annotations

import torch

from trtc.compiler.quantize.layers import decoder_layers

FP8_MAX = 448.0
HEADROOM = 2.0


def _pair_norm_amax(k: torch.Tensor, head_dim: int) -> float:
    heads = k.detach().float().reshape(-1, head_dim)  # [tokens * kv_heads, D]
    half = head_dim // 2
    return float(torch.sqrt(heads[:, :half] ** 2 + heads[:, half:] ** 2).max())


def scale_for(amax: float) -> float:
    return HEADROOM * amax / FP8_MAX if amax > 0 else 1.0


@torch.no_grad()
def calibrate_kv_scales(
    hf_model, token_batches: list[list[int]], head_dim: int, batch_size: int = 8
) -> list[tuple[float, float]]:
    """``[(k_scale, v_scale)]`` per decoder layer, from one forward over the calibration set."""
    layers = decoder_layers(hf_model)
    amax = [[0.0, 0.0] for _ in layers]
    handles = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn

        def on_k(module, args, out, i=i):
            amax[i][0] = max(amax[i][0], _pair_norm_amax(out, head_dim))

        def on_v(module, args, out, i=i):
            amax[i][1] = max(amax[i][1], float(out.detach().abs().max()))

        handles += [
            attn.k_proj.register_forward_hook(on_k),
            attn.v_proj.register_forward_hook(on_v),
        ]
    was_training = hf_model.training
    hf_model.eval()
    try:
        for chunk in torch.tensor(token_batches, dtype=torch.long).split(batch_size):
            hf_model(input_ids=chunk, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        hf_model.train(was_training)
    return [(scale_for(k), scale_for(v)) for k, v in amax]
