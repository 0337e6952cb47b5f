"""`trtc::Fp8Gemm` — the semantic definition (torch, CPU).

FP8 (E4M3) weights and activations. Every other implementation (Triton kernels,
``torch._scaled_mm`` on Hopper, the TensorRT plugin, the TensorRT-RTX Q/DQ lowering) is tested
against `fp8_gemm`.

Inputs

* ``x``: ``[T, K]`` activations, fp16, bf16 or fp32 (leading dims are flattened here).
* ``weight``: ``float8_e4m3fn [N, K]``.
* ``weight_scale``: fp32 ``[N]``, one per output channel.
* ``input_scale``: fp32 ``[]``, one per tensor, static (calibrated at build time).
* ``bias``: optional ``[N]`` (absent from the node when the layer has none).

Attributes ``in_features`` (K), ``out_features`` (N).

Semantics, computed in fp32 and returned in x's dtype::

    fp8(v)  = v clamped to [-448, 448], then rounded to the nearest E4M3 value (ties to even)
    x_q     = fp8(x / input_scale) * input_scale             # the activation as the kernel sees it
    W       = weight * weight_scale[:, None]
    y       = x_q @ W.T + bias

Saturation (not NaN or inf) for out-of-range activations is part of the contract: a token
whose activations exceed the calibrated range is clipped, as every FP8 GEMM library does.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def to_fp8(v: torch.Tensor) -> torch.Tensor:
    """Saturating cast to E4M3 (round to nearest even); NaN stays NaN."""
    return v.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def check_shapes(
    x, weight, weight_scale, input_scale, bias, in_features: int, out_features: int
) -> None:
    k, n = in_features, out_features
    if (
        x.shape[-1] != k
        or tuple(weight.shape) != (n, k)
        or tuple(weight_scale.shape) != (n,)
        or input_scale.numel() != 1
        or (bias is not None and tuple(bias.shape) != (n,))
    ):
        raise ValueError(
            f"Fp8Gemm: shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, weight_scale "
            f"{tuple(weight_scale.shape)}, input_scale {tuple(input_scale.shape)}, bias "
            f"{None if bias is None else tuple(bias.shape)} do not fit K={k}, N={n}"
        )
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"Fp8Gemm: weight must be float8_e4m3fn, got {weight.dtype}")


def fp8_gemm(
    x, weight, weight_scale, input_scale, bias=None, *, in_features: int, out_features: int
) -> torch.Tensor:
    """``y [T, N]`` per the module docstring, in fp32, returned in x's dtype."""
    check_shapes(x, weight, weight_scale, input_scale, bias, in_features, out_features)
    s_in = input_scale.float().reshape(())
    x_q = to_fp8(x.float() / s_in).float() * s_in
    w = weight.float() * weight_scale.float()[:, None]
    y = x_q @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
