"""Triton kernels for the elementwise ops of a trtc graph on CUDA: RMSNormalization, RotaryEmbedding
and SwiGLU, each one kernel instead of the several small ones their torch spelling launches (a
decode step of a small model is dominated by the number of kernels, not by their work).
Semantics are those of `torch_ops.py` (the ONNX definitions); tests compare the two."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtc.plugins.kernels import pdl
from trtc.plugins.paged_attention.triton_kernels import to_cache


@triton.jit
def _rms_norm(x_ptr, w_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask)  # a weight: read before the wait
    pdl.begin(PDL)
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    # As the ONNX op with stash_type fp32: normalise in fp32, cast to X's type, scale.
    y = (x * rstd).to(x_ptr.dtype.element_ty) * w
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty(x2.shape, dtype=weight.dtype, device=x.device)
    n = x2.shape[1]
    _rms_norm[(x2.shape[0],)](
        x2, weight, y, n, eps, BLOCK=triton.next_power_of_2(n), **pdl.launch_options(x.device)
    )
    return y.view(x.shape)


@triton.jit
def _rotary(
    x_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    y_ptr,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HALF_P2: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token: all heads, non-interleaved halves, cos/sin tables indexed by position."""
    pdl.begin(PDL)
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
    y1, y2 = rotate_halves(x1, x2, c, s, y_ptr.dtype.element_ty)
    tl.store(y_ptr + base, y1, mask=mask)
    tl.store(y_ptr + base + HALF, y2, mask=mask)


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, num_heads: int
) -> torch.Tensor:
    """``x[1, T, heads*D]`` (ONNX RotaryEmbedding's 3-D form), tables ``[max_pos, D/2]``."""
    tokens = x.shape[1]
    half = cos.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    _rotary[(tokens,)](
        x,
        cos,
        sin,
        positions.reshape(-1),
        y,
        HEADS=num_heads,
        HALF=half,
        HEADS_P2=triton.next_power_of_2(num_heads),
        HALF_P2=triton.next_power_of_2(half),
        **pdl.launch_options(x.device),
    )
    return y


@triton.jit
def _swiglu(x_ptr, y_ptr, inner, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
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
    _swiglu[(x2.shape[0], triton.cdiv(inner, block))](
        x2, y, inner, BLOCK=block, **pdl.launch_options(x.device)
    )
    return y.view(*x.shape[:-1], inner)


# --- Fused kernels: what the CUDA executor runs in place of several graph nodes -------------
# (see runtime/executors/fusions/; each computes exactly what its nodes compute one after the
# other).


@triton.jit
def _add_rms_norm(
    a_ptr, b_ptr, w_ptr, sum_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """ONNX Add (the residual) then RMSNormalization of the sum: both outputs, one pass."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask)  # a weight: read before the wait
    pdl.begin(PDL)
    a = tl.load(a_ptr + row * n_cols + cols, mask=mask, other=0.0)
    b = tl.load(b_ptr + row * n_cols + cols, mask=mask, other=0.0)
    s = (a.to(tl.float32) + b.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # Add's one rounding
    tl.store(sum_ptr + row * n_cols + cols, s, mask=mask)
    x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = (x * rstd).to(sum_ptr.dtype.element_ty) * w
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a + b, RMSNormalization(a + b) * weight)`` over the last axis (stash type fp32)."""
    a2, b2 = a.reshape(-1, a.shape[-1]).contiguous(), b.reshape(-1, b.shape[-1]).contiguous()
    total = torch.empty_like(a2)
    y = torch.empty(a2.shape, dtype=weight.dtype, device=a.device)
    n = a2.shape[1]
    _add_rms_norm[(a2.shape[0],)](
        a2,
        b2,
        weight,
        total,
        y,
        n,
        eps,
        BLOCK=triton.next_power_of_2(n),
        **pdl.launch_options(a.device),
    )
    return total.view(a.shape), y.view(a.shape)


@triton.jit
def rotate_halves(x1, x2, c, s, out_ty: tl.constexpr):
    """Non-interleaved RoPE of one head's halves (`_rotary`, `_qkv_rotary_write` and the
    fragment kernel's epilogue), in the type x and the tables promote to, rounded to
    ``out_ty``: one fma a half, each product of ``s`` rounded first (within an ulp of the
    torch spelling, which rounds every product). The fmas are spelled out: left to the
    compiler, ``x1 * c - x2 * s`` may fuse either product, and kernels compiled apart (the
    fragment kernel's q/k/v epilogue) would round apart."""
    p1, p2 = x1 * s, x2 * s  # in the type x and the tables promote to
    ty = p1.dtype
    cp = c.to(ty)
    return tl.fma(x1.to(ty), cp, -p2).to(out_ty), tl.fma(x2.to(ty), cp, p1).to(out_ty)


@triton.jit
def _qkv_rotary_write(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    q_ptr,
    cache_ptr,
    qkv_stride,
    cache_kv_stride,
    k_scale,
    v_scale,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_P2: tl.constexpr,
    KV_P2: tl.constexpr,
    HALF_P2: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token of the merged QKV GEMM output: rotate q into ``q_ptr``, rotate k and write it
    and v into the token's cache slot (nothing when the slot is negative: padding)."""
    pdl.begin(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, HALF_P2)
    d_ok = d < HALF
    c = tl.load(cos_ptr + pos * HALF + d, mask=d_ok, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * HALF + d, mask=d_ok, other=0.0)[None, :]
    row = qkv_ptr + token * qkv_stride
    D: tl.constexpr = 2 * HALF

    h = tl.arange(0, HEADS_P2)
    mask = (h[:, None] < HEADS) & d_ok[None, :]
    at = h[:, None] * D + d[None, :]
    q1, q2 = rotate_halves(
        tl.load(row + at, mask=mask, other=0.0),
        tl.load(row + at + HALF, mask=mask, other=0.0),
        c,
        s,
        q_ptr.dtype.element_ty,
    )
    tl.store(q_ptr + token * HEADS * D + at, q1, mask=mask)
    tl.store(q_ptr + token * HEADS * D + at + HALF, q2, mask=mask)

    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        kh = tl.arange(0, KV_P2)
        kmask = (kh[:, None] < KV_HEADS) & d_ok[None, :]
        kat = kh[:, None] * D + d[None, :]
        k_row = row + HEADS * D
        k1, k2 = rotate_halves(
            tl.load(k_row + kat, mask=kmask, other=0.0),
            tl.load(k_row + kat + HALF, mask=kmask, other=0.0),
            c,
            s,
            q_ptr.dtype.element_ty,
        )
        v_row = k_row + KV_HEADS * D
        v1 = tl.load(v_row + kat, mask=kmask, other=0.0)
        v2 = tl.load(v_row + kat + HALF, mask=kmask, other=0.0)
        dst = cache_ptr + slot.to(tl.int64) * KV_HEADS * D + kat
        ty = cache_ptr.dtype.element_ty
        tl.store(dst, to_cache(k1, k_scale, ty, FP8), mask=kmask)
        tl.store(dst + HALF, to_cache(k2, k_scale, ty, FP8), mask=kmask)
        tl.store(dst + cache_kv_stride, to_cache(v1, v_scale, ty, FP8), mask=kmask)
        tl.store(dst + cache_kv_stride + HALF, to_cache(v2, v_scale, ty, FP8), mask=kmask)


def qkv_rotary_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """``qkv [T, (H + 2 KV) * D]`` (q, k, v side by side, rows may be strided) -> rotated q
    ``[T, H * D]``; rotated k and v written into ``kv_cache [2, blocks, block_size, KV, D]`` at
    ``slot_mapping`` (the PagedAttention plugin's write, its FP8 scaling included)."""
    tokens = qkv.shape[0]
    half = cos.shape[-1]
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty(tokens, num_heads * 2 * half, dtype=qkv.dtype, device=qkv.device)
    _qkv_rotary_write[(tokens,)](
        qkv,
        cos,
        sin,
        positions.reshape(-1),
        slot_mapping,
        q,
        kv_cache,
        qkv.stride(0),
        kv_cache.stride(0),
        k_scale,
        v_scale,
        HEADS=num_heads,
        KV_HEADS=num_kv_heads,
        HALF=half,
        HEADS_P2=triton.next_power_of_2(num_heads),
        KV_P2=triton.next_power_of_2(num_kv_heads),
        HALF_P2=triton.next_power_of_2(half),
        FP8=kv_cache.dtype == torch.float8_e4m3fn,
        **pdl.launch_options(qkv.device),
    )
    return q
