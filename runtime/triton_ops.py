"""Triton kernels for the elementwise ops of a trtc graph on CUDA: RMSNormalization, RotaryEmbedding
and SwiGLU, each one kernel instead of the several small ones their torch spelling launches (a
decode step of a small model is dominated by the number of kernels, not by their work).
Semantics are those of `torch_ops.py` (the ONNX definitions); tests compare the two."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, w_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask)
    # As the ONNX op with stash_type fp32: normalise in fp32, cast to X's type, scale.
    y = (x * rstd).to(x_ptr.dtype.element_ty) * w
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty(x2.shape, dtype=weight.dtype, device=x.device)
    n = x2.shape[1]
    _rms_norm[(x2.shape[0],)](x2, weight, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return y.view(x.shape)


@triton.jit
def _rotary(x_ptr, cos_ptr, sin_ptr, pos_ptr, y_ptr, HEADS: tl.constexpr, HALF: tl.constexpr,
            HEADS_P2: tl.constexpr, HALF_P2: tl.constexpr):
    """One token: all heads, non-interleaved halves, cos/sin tables indexed by position."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token)
    h = tl.arange(0, HEADS_P2)
    d = tl.arange(0, HALF_P2)
    mask = (h[:, None] < HEADS) & (d[None, :] < HALF)
    base = token * HEADS * 2 * HALF + h[:, None] * 2 * HALF + d[None, :]
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + base + HALF, mask=mask, other=0.0)
    c = tl.load(cos_ptr + pos * HALF + d, mask=d < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * HALF + d, mask=d < HALF, other=0.0)[None, :]
    # In the input dtype, as the torch spelling computes it.
    tl.store(y_ptr + base, (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + base + HALF, (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           num_heads: int) -> torch.Tensor:
    """``x[1, T, heads*D]`` (ONNX RotaryEmbedding's 3-D form), tables ``[max_pos, D/2]``."""
    tokens = x.shape[1]
    half = cos.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    _rotary[(tokens,)](x, cos, sin, positions.reshape(-1), y, HEADS=num_heads, HALF=half,
                       HEADS_P2=triton.next_power_of_2(num_heads), HALF_P2=triton.next_power_of_2(half))
    return y


@triton.jit
def _swiglu(x_ptr, y_ptr, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * 2 * inner + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inner + inner + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * inner + cols, silu * up, mask=mask)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    inner = x2.shape[1] // 2
    y = torch.empty(x2.shape[0], inner, dtype=x.dtype, device=x.device)
    block = 1024
    _swiglu[(x2.shape[0], triton.cdiv(inner, block))](x2, y, inner, BLOCK=block)
    return y.view(*x.shape[:-1], inner)
