"""`trtc::Fp8Gemm` on CUDA. Semantics are the reference's (`reference.py`)::

    x_q = fp8(x / input_scale)                  # saturating E4M3 cast, exactly `to_fp8`
    y   = (x_q * input_scale) @ (weight * weight_scale[:, None]).T + bias    # fp32, then x's dtype

Where the device has FP8 matrix units (compute capability >= 8.9) and the shape suits them (K and
N multiples of 16), ``torch._scaled_mm`` multiplies the E4M3 operands as they are, with exact
products and fp32 accumulation (``use_fast_accum=False``), and applies the scales to the fp32
result: ``(x_q @ weight.T) * input_scale * weight_scale[n]``, equal to the reference's product up to
the rounding of fp32 sums. The recipe, the first that this torch build accepts (found once per
device, dtype and bias, on the first call, and reused):

1. rowwise scaling, ``scale_a = input_scale`` broadcast to ``[T, 1]``, ``scale_b = weight_scale``
   as ``[1, N]``, output in x's dtype with the bias fused in the epilogue (one rounding);
2. rowwise scaling with an fp32 output, the bias added and the cast done after;
3. tensorwise scaling (``input_scale`` and 1) with an fp32 output, then ``* weight_scale + bias``
   and the cast.

Anything else (compute capability below 8.9, K or N not a multiple of 16, no recipe accepted)
runs the reference itself on the GPU: dequantize both operands to fp32 and matmul (correct, and
as slow as an fp32 GEMM). The launch depends on shapes only (no host syncs), so a decode step
can be captured in a CUDA graph once the first call has picked the recipe.
"""

from __future__ import annotations

import functools

import torch

from trtc.gpu_profiles import has_feature
from trtc.plugins.fp8_gemm.reference import check_shapes, to_fp8
from trtc.plugins.fp8_gemm.reference import fp8_gemm as reference

ROWWISE_NATIVE, ROWWISE_FP32, TENSORWISE_FP32 = "rowwise", "rowwise-fp32", "tensorwise-fp32"
RECIPES = (ROWWISE_NATIVE, ROWWISE_FP32, TENSORWISE_FP32)
_recipe: dict[tuple, str | None] = {}  # (device index, x dtype, has bias) -> recipe
_ones: dict[torch.device, torch.Tensor] = {}


def has_fp8_matmul(device: torch.device) -> bool:
    return _has_fp8_matmul(
        device.index if device.index is not None else torch.cuda.current_device()
    )


@functools.cache
def _has_fp8_matmul(device_index: int) -> bool:
    return hasattr(torch, "_scaled_mm") and has_feature(device_index, "fp8_matmul")


def uses_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this call's shape can go to ``torch._scaled_mm`` (else: the reference)."""
    n, k = weight.shape
    return x.is_cuda and has_fp8_matmul(x.device) and k % 16 == 0 and n % 16 == 0


def quantize_input(x2: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """``fp8(x / input_scale)``: the reference's ops, so the same E4M3 bits."""
    return to_fp8(x2.float() / input_scale.float().reshape(()))


def _one(device: torch.device) -> torch.Tensor:
    """A scale of 1 (tensorwise ``scale_b``), made once per device, not per call."""
    if device not in _ones:
        _ones[device] = torch.ones((), dtype=torch.float32, device=device)
    return _ones[device]


def _scaled_mm(recipe: str, x_q, weight, weight_scale, input_scale, bias, out_dtype):
    """One recipe: ``y`` in ``out_dtype`` (bias included), or an exception if refused."""
    tokens = x_q.shape[0]
    w_t = weight.t()  # [K, N] column-major, as cuBLASLt wants
    s_in = input_scale.float().reshape(1, 1)
    s_w = weight_scale.float().reshape(1, -1).contiguous()
    if recipe == ROWWISE_NATIVE:
        return torch._scaled_mm(
            x_q,
            w_t,
            s_in.expand(tokens, 1).contiguous(),
            s_w,
            bias=None if bias is None else bias.to(out_dtype),
            out_dtype=out_dtype,
            use_fast_accum=False,
        )
    if recipe == ROWWISE_FP32:
        y = torch._scaled_mm(
            x_q,
            w_t,
            s_in.expand(tokens, 1).contiguous(),
            s_w,
            out_dtype=torch.float32,
            use_fast_accum=False,
        )
    else:
        y = torch._scaled_mm(
            x_q,
            w_t,
            s_in.reshape(()),
            _one(x_q.device),
            out_dtype=torch.float32,
            use_fast_accum=False,
        )
        y = y * s_w
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_gemm(
    x, weight, weight_scale, input_scale, bias=None, *, in_features: int, out_features: int
) -> torch.Tensor:
    """``y [..., N]`` per the module docstring, for CUDA tensors."""
    check_shapes(x, weight, weight_scale, input_scale, bias, in_features, out_features)
    if uses_scaled_mm(x, weight):
        x2 = x.reshape(-1, in_features)
        if x2.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], out_features)
        y = _first_recipe(
            x, quantize_input(x2, input_scale), weight, weight_scale, input_scale, bias
        )
        if y is not None:
            return y.view(*x.shape[:-1], out_features)
    return reference(
        x,
        weight,
        weight_scale,
        input_scale,
        bias,
        in_features=in_features,
        out_features=out_features,
    )


def _first_recipe(x, x_q, weight, weight_scale, input_scale, bias) -> torch.Tensor | None:
    """``y [T, N]`` by the recipe found for x's device and dtype (and a bias or not), else by
    the first one this torch build accepts (kept for later calls); None if none is accepted."""
    weight = weight.contiguous()
    key = (x.device.index, x.dtype, bias is not None)
    known = _recipe.get(key)
    for recipe in ((known,) if known else ()) + tuple(r for r in RECIPES if r != known):
        try:
            y = _scaled_mm(recipe, x_q, weight, weight_scale, input_scale, bias, x.dtype)
        except (RuntimeError, ValueError, NotImplementedError, TypeError):
            continue  # this torch build refuses the recipe: try the next one
        _recipe.setdefault(key, recipe)
        return y
    return None


def recipe_for(x: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """The recipe that calls with x's device and dtype (and a bias or not) use once a first
    call has found one; None before that, or when none is accepted (the reference runs)."""
    return _recipe.get((x.device.index, x.dtype, bias is not None))
