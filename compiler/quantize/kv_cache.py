"""Scales of an FP8 (E4M3) KV cache, calibrated on text.

The cache stores ``fp8(k / k_scale)`` and ``fp8(v / v_scale)`` with one static scale per layer
for keys and one for values (the `trtc::PagedAttention` contract). Here::

    k_scale = HEADROOM * amax_k / 448,   v_scale = HEADROOM * amax_v / 448

``amax_v`` is the largest |v_proj output| over the calibration tokens. Keys are cached after the
rotary embedding, which turns each pair ``(x_i, x_{i + D/2})`` of a head by an angle: no rotated
value exceeds the pair's norm, so ``amax_k`` is the largest such norm of the keys as they enter
the rotary (the k_proj output; after the per-head ``k_norm`` for models that have one, Qwen3),
a bound that holds at every position, not only the calibrated ones. ``HEADROOM`` (2) leaves room for
activations larger than any the calibration text produced before they saturate; E4M3 keeps the
same relative precision (3 mantissa bits) over its whole normal range, so the headroom costs
only the smallest values.

The amax are taken on the floating-point model the artifact holds (AWQ-folded after AWQ), one
decoder layer at a time, while quantizing (`apply.quantize_source` with ``kv_cache_scales``).
"""

from __future__ import annotations

import torch
from torch import nn

from trtc.compiler.quantize.calibration import CalibrationData
from trtc.compiler.quantize.layers import output_hooks

FP8_MAX = 448.0
HEADROOM = 2.0


def _pair_norm_amax(k: torch.Tensor, head_dim: int) -> float:
    heads = k.detach().float().reshape(-1, head_dim)  # [tokens * kv_heads, D]
    half = head_dim // 2
    return float(torch.sqrt(heads[:, :half] ** 2 + heads[:, half:] ** 2).max())


def scale_for(amax: float) -> float:
    return HEADROOM * amax / FP8_MAX if amax > 0 else 1.0


class KVAmax:
    """The running amax of one decoder layer's keys (rotary pair norms) and values."""

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self.k = 0.0
        self.v = 0.0

    def hooks(self, layer: nn.Module) -> list:
        """Forward hooks on the modules whose outputs are cached (the last before the rotary
        for keys: ``k_norm`` where the layer has one, else k_proj; v_proj for values) that
        update the amax (for `layers.hooks`)."""
        keys = "self_attn.k_norm" if hasattr(layer.self_attn, "k_norm") else "self_attn.k_proj"

        def on_output(path: str, out: torch.Tensor) -> None:
            if path == keys:
                self.k = max(self.k, _pair_norm_amax(out, self.head_dim))
            else:
                self.v = max(self.v, float(out.abs().max()))

        return output_hooks(layer, (keys, "self_attn.v_proj"), on_output)

    def scales(self) -> tuple[float, float]:
        """``(k_scale, v_scale)``."""
        return scale_for(self.k), scale_for(self.v)


def scales_record(scales: list[tuple[float, float]], calibration: CalibrationData) -> dict:
    """The manifest's record of the scales ``[(k_scale, v_scale)]`` and how they were found."""
    return {
        "format": "e4m3fn, stored = fp8(x / scale), one scale per layer for K and for V",
        "rule": f"scale = {HEADROOM:g} * amax / 448 (K: amax of rotary pair norms)",
        "calibration": calibration.record(),
        "k": [k for k, _ in scales],
        "v": [v for _, v in scales],
    }
