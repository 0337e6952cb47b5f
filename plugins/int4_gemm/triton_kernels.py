"""`trtc::Int4Gemm` in Triton: the CUDA implementation. Semantics are the reference's
(`reference.py`: ``y = x @ ((q - zeros) * scales).T + bias`` with fp32 accumulation, returned in
x's dtype; the last group of a row may be shorter); tests compare the two.

The split-K dot kernel, `_int4_dot`, for prefill and decode steps (1..16 tokens: one 16-wide
tile): ``W_tile @ x_tile.T`` on the matrix units, weight rows on the M side. The packed weight
(``qweight [N, K/2]``, low nibble = even k) is read as stored, once; a program owns ``BLOCK_N``
rows and ``BLOCK_T`` tokens and walks K in steps of ``BLOCK_K`` columns, several groups a step,
so each row is read in ``BLOCK_K / 2`` contiguous bytes (Triton pipelines these loads through
shared memory with cp.async). Each step:

* the weight is dequantized in registers by inline PTX, two weights per instruction: a nibble
  OR-ed into the mantissa of 1024 (fp16) or 128 (bf16) is ``1024 + q`` exactly, ``+ -(1024 +
  z)`` gives ``q - z`` exactly, one multiply by the group's scale rounds once to x's dtype (the
  operand the matrix units take: within the fp16/bf16 tolerances, not the reference's fp32
  weight). Triton's CPU interpreter, and fp32 activations, take portable ops instead;
* low nibbles meet the even columns of x and high nibbles the odd ones (two dots), so a byte is
  never re-interleaved; the columns of both operands are put in an order (`_mma_order`) in which
  each thread's share of the weight tile is 16 contiguous bytes of shared memory;
* the step's zeros and scales (2-4 bytes of a row, too short for cp.async, so Triton does not
  pipeline them) are loaded one step ahead into registers, so a step does not wait a whole
  memory round trip for them (two steps ahead, Triton stops pipelining the loop at all).

Decode row blocks alone do not fill the SMs (4096 rows are 64 blocks of 64), so K is split over
``split_k`` programs per row block; each writes fp32 partial sums to a workspace ``[split_k, T,
N]`` and the sums are added in split order (deterministic, no float atomics), either by a second
kernel (``reduce="kernel"``) or by the last program of the row block to finish (``reduce="last"``:
one launch; programs count arrivals on a per-tile int32 counter that the last one resets). The
launch depends on shapes only (no host syncs): a decode step can be captured in a CUDA graph.
Decode launches use programmatic dependent launch (`trtc.plugins.kernels.pdl`): a program reads
its first zeros and scales before waiting for the previous kernel, and (``Plan.prefetch``) may
first ask L2 for its whole slice of the packed weight, one bulk prefetch a row
(`_prefetch_rows`).

A second kernel, `_int4_rows`, serves the decode steps of one or two tokens where it is the
faster one (`default_plan`): "weights first", as the dense GEMV of plugins/kernels/gemv.py. A
program owns ``ROWS`` whole rows (no split over K: no partial sums, no reduction tail) and
requests all of their packed bytes, zeros and scales *before* waiting for the previous kernel (a
row that is no power of two long is loaded as up to three power-of-two pieces; or, for a plan's
shorter steps, the first step before the wait and each next one a step ahead, into registers).
After the wait it reads x and reduces in CUDA cores: the asm above without the scale gives ``q -
z`` exactly in fp16, converted to fp32 and multiplied by x in fp32 FMAs, one sum per group then
times its scale (so the weight is never rounded: closer to the reference than the dot kernel).
With fp16 activations (``Plan.half2``, `_step_half2`) the products are packed f16x2 FMAs instead:
the weight read as 32-bit words, x as int32 column pairs put in the weight's lane order, four
products a lane summed in fp16 and then in fp32 (x taken times 1/16 so that those sums cannot
overflow), two products an instruction. Each token is one more pass of FMAs, so it takes few
tokens (`ROWS_MAX_TOKENS`). The kernels' design choices and their measurements:
docs/gpu-kernels.md, "Int4Gemm".
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from trtc.gpu_profiles import has_feature, sm_count
from trtc.plugins.kernels import pdl
from trtc.plugins.kernels.arrival_counters import arrival_counters

# Dot operand modes: fp16, bf16, fp32 (fp32 activations; and bf16 ones in Triton's CPU
# interpreter, whose bf16 arithmetic is not implemented).
FP16, BF16, FP32 = 0, 1, 2
# What the programs of a split row block do with their partial sums.
NO_SPLIT, SPLIT_THEN_KERNEL, SPLIT_LAST_SUMS = 0, 1, 2


# --- helpers --------------------------------------------------------------------------------


@triton.jit
def _write_y(acc, offs, mask, rows, row_ok, bias_ptr, y_ptr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# --- the dot kernel (matrix units) ----------------------------------------------------------

# Dequantization of 4 packed bytes (8 weights) in one asm block, two weights per instruction.
# A PRMT spreads two bytes into the two 16-bit lanes; a LOP3 ORs a nibble into the mantissa of
# 1024 (fp16) or 128 (bf16), where one unit is worth 1; adding the negated zero gives q - z
# exactly, and one multiply by the scale rounds once (the weight the matrix units see). fp16 keeps
# the high nibble in place (1024 + 16 q, times 1/16 in the FMA: exact); bf16 has 7 mantissa
# bits, so the high nibble is shifted down first.


def _f16_nibbles(lo: tuple[str, str], hi: tuple[str, str], out: str) -> str:
    """The fp16 asm: ``$4`` the 4 bytes; ``lo`` the operands holding -(1024 + z) for the low
    nibbles of bytes 0, 1 and of bytes 2, 3, ``hi`` -(64 + z) for the high ones; then ``out``,
    which leaves the results in ``$0, $1`` (low nibbles) and ``$2, $3`` (high) from registers
    ``l0, l1, h0, h1`` (q - z)."""
    return f"""{{
.reg .b32 t0, t1, l0, l1, h0, h1, c;
mov.b32 c, 0x2C002C00;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 l0, t0, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 l1, t1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 h0, t0, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 h1, t1, 0x00F000F0, 0x64006400, 0xEA;
add.f16x2 l0, l0, {lo[0]};
add.f16x2 l1, l1, {lo[1]};
fma.rn.f16x2 h0, h0, c, {hi[0]};
fma.rn.f16x2 h1, h1, c, {hi[1]};
{out}}}
"""


# The asm's last lines: the weights times their scales ($9, $10), or q - z as it is.
_SCALED = """mul.f16x2 $0, l0, $9;
mul.f16x2 $1, l1, $10;
mul.f16x2 $2, h0, $9;
mul.f16x2 $3, h1, $10;
"""
_UNSCALED = """mov.b32 $0, l0;
mov.b32 $1, l1;
mov.b32 $2, h0;
mov.b32 $3, h1;
"""
# The dot kernel's operands: $0,$1 the low-nibble weights (4 halves), $2,$3 the high-nibble ones;
# $4 the 4 bytes; $5,$6 -(1024 + z) (fp16) or -(128 + z) (bf16) per element; $7,$8 -(64 + z)
# (fp16 only, unused in bf16); $9,$10 the scales.
_DEQUANT_F16 = tl.constexpr(_f16_nibbles(("$5", "$6"), ("$7", "$8"), _SCALED))
# The same without the scale: q - z exactly, in fp16 (the CUDA-core kernel scales a group's sum).
_NIBBLES_F16 = tl.constexpr(_f16_nibbles(("$5", "$6"), ("$7", "$8"), _UNSCALED))
_DEQUANT_BF16 = tl.constexpr("""
{
.reg .b32 t0, t1, u0, u1, l0, l1, h0, h1;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shr.b32 u0, t0, 4;
shr.b32 u1, t1, 4;
lop3.b32 l0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 l1, t1, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 h0, u0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 h1, u1, 0x000F000F, 0x43004300, 0xEA;
add.rn.bf16x2 l0, l0, $5;
add.rn.bf16x2 l1, l1, $6;
add.rn.bf16x2 h0, h0, $5;
add.rn.bf16x2 h1, h1, $6;
mul.rn.bf16x2 $0, l0, $9;
mul.rn.bf16x2 $1, l1, $10;
mul.rn.bf16x2 $2, h0, $9;
mul.rn.bf16x2 $3, h1, $10;
}
""")


@triton.jit
def _dequant_terms(zero, scale, MODE: tl.constexpr, ASM: tl.constexpr):
    """The operands of the dequantization asm (or the portable ops) besides the bytes: (offset
    of the low nibbles, of the high nibbles, scale). `_int4_rows` computes them once per group,
    before broadcasting them over the group's bytes."""
    if ASM:
        if MODE == 0:
            off_lo = (-1024.0 - zero.to(tl.float32)).to(tl.float16)
            off_hi = (-64.0 - zero.to(tl.float32)).to(tl.float16)
        else:
            off_lo = (-128.0 - zero.to(tl.float32)).to(tl.bfloat16)
            off_hi = off_lo
    else:
        off_lo = zero.to(tl.float32)
        off_hi = off_lo
        scale = scale.to(tl.float32)
    return off_lo, off_hi, scale


@triton.jit
def _dequantize(packed, zero, scale, MODE: tl.constexpr, ASM: tl.constexpr):
    """Both nibbles of each byte as weights ``(q - z) * s`` in the dot's dtype."""
    off_lo, off_hi, scale = _dequant_terms(zero, scale, MODE, ASM)
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            _DEQUANT_F16 if MODE == 0 else _DEQUANT_BF16,
            "=r,=r,=r,=r,r,r,r,r,r,r,r",
            [packed, off_lo, off_hi, scale],
            dtype=(tl.float16, tl.float16) if MODE == 0 else (tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        # Portable (fp32 activations, Triton's CPU interpreter): the same function in fp32,
        # rounded once to the dot's dtype.
        dtype = tl.float16 if MODE == 0 else tl.float32
        lo = (((packed & 0xF).to(tl.float32) - off_lo) * scale).to(dtype)
        hi = (((packed >> 4).to(tl.float32) - off_hi) * scale).to(dtype)
    return lo, hi


@triton.jit
def _mma_order(t, R: tl.constexpr, C: tl.constexpr):
    """``[R, C]`` in memory order -> the column order the dot runs over. The weight operand of
    a 16-wide step of the matrix units gives each thread the columns 2c, 2c+1, 2c+8 and 2c+9;
    taken over four steps (64 columns), this order hands thread c the 16 contiguous bytes
    16c..16c+15, so the packed tile is read from shared memory 16 bytes at a time instead of
    2 (and no byte shuffling before the asm). The activations get the same order (the sum over
    K does not care)."""
    t = tl.reshape(t, (R, C // 64, 4, 4, 2, 2))  # column p = 64 i + 16 c + 4 s + 2 h + e
    t = tl.permute(t, (0, 1, 3, 4, 2, 5))  # position 64 i + 16 s + 8 h + 2 c + e
    return tl.reshape(t, (R, C))


@triton.jit
def _dot(a, b, acc, MODE: tl.constexpr):
    if MODE == 2:
        # fp32 operands: full fp32 products, as the reference (tf32 would round x).
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _load_meta(zeros_ptr, scales_ptr, meta, row_ok, i, G, GPS: tl.constexpr):
    """Step ``i``'s zeros and scales ``[BLOCK_N, GPS]`` (zeros past the last group)."""
    g = i * GPS + tl.arange(0, GPS)
    ok = row_ok[:, None] & (g[None, :] < G)
    return (
        tl.load(zeros_ptr + meta + g[None, :], mask=ok, other=0),
        tl.load(scales_ptr + meta + g[None, :], mask=ok, other=0.0),
    )


# One bulk L2 prefetch (sm_90: the copy engine fetches ``$2`` bytes from ``$1`` into L2; no
# registers, no completion to wait for) where ``$2`` is not 0. ``$1`` and ``$2`` must be
# multiples of 16 (the launch checks the row stride and the base).
_PREFETCH_L2 = tl.constexpr("""
{
.reg .pred p;
setp.ne.u32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}
""")


@triton.jit
def _prefetch_rows(qweight_ptr, rows, row_ok, KB, byte_begin, byte_end):
    """Ask L2 for bytes ``byte_begin .. byte_end`` of each row of ``rows`` (one bulk prefetch a
    row). The packed weight is constant (trtc.plugins.kernels.pdl), so this goes before the
    wait: the whole slice streams from HBM while the previous kernel finishes, and the pipelined
    loop after the wait reads it from L2."""
    end = tl.minimum(byte_end, KB)
    nbytes = tl.where(row_ok & (end > byte_begin), end - byte_begin, 0).to(tl.int32)
    addr = (qweight_ptr + rows.to(tl.int64) * KB + byte_begin).to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise(
        _PREFETCH_L2, "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit(do_not_specialize=["T", "iters_per_split", "splits"])
def _int4_dot(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    y_ptr,
    partial_ptr,
    counter_ptr,
    T,
    N,
    K,
    KB,
    G,
    iters_per_split,
    splits,
    GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,
    ASM: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    """``BLOCK_T`` tokens x ``BLOCK_N`` rows; K in steps of ``BLOCK_K`` columns (several groups:
    each row is read ``BLOCK_K / 2`` contiguous bytes at a time). The loads are pipelined by
    Triton (cp.async into shared memory, ``num_stages``); with ``PREFETCH`` the program's whole
    slice of the packed weight is first requested into L2, before the wait."""
    HALF: tl.constexpr = GROUP // 2
    GPS: tl.constexpr = BLOCK_K // GROUP  # groups per step
    BKB: tl.constexpr = BLOCK_K // 2  # packed bytes per row per step
    tile = tl.program_id(0)
    split = tl.program_id(1)
    t_tiles = tl.cdiv(T, BLOCK_T)
    # Token tiles vary fastest: the programs that share a weight tile run side by side, so a
    # prefill reads each weight byte from HBM about once.
    toks = (tile % t_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = (tile // t_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    tok_ok = toks < T
    row_ok = rows < N
    w_rows = qweight_ptr + rows.to(tl.int64)[:, None] * KB
    meta = rows.to(tl.int64)[:, None] * G
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    i_begin = split * iters_per_split
    i_end = tl.minimum(i_begin + iters_per_split, tl.cdiv(K, BLOCK_K))
    # The zeros and scales of a step are 2 or 4 bytes of a row (too short for cp.async, so
    # Triton does not pipeline them): loaded one step ahead into registers, or every step would
    # wait a full memory round trip for them. (Two steps ahead, Triton gives up pipelining the
    # weight and x loads.)
    zero0, scale0 = _load_meta(zeros_ptr, scales_ptr, meta, row_ok, i_begin, G, GPS)
    if PREFETCH:
        _prefetch_rows(qweight_ptr, rows, row_ok, KB, i_begin * BKB, i_end * BKB)
    # x, y, the partial sums and the counters may belong to earlier kernels; the zeros and
    # scales above do not (trtc.plugins.kernels.pdl).
    pdl.begin(PDL)
    for i in range(i_begin, i_end):
        zero1, scale1 = _load_meta(zeros_ptr, scales_ptr, meta, row_ok, i + 1, G, GPS)
        byte = i * BKB + tl.arange(0, BKB)
        col = i * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w_ok = row_ok[:, None]
            x_ok = tok_ok[:, None]
        else:
            w_ok = row_ok[:, None] & (byte[None, :] < KB)
            x_ok = tok_ok[:, None] & (col[None, :] < K)
        packed = tl.load(
            w_rows + byte[None, :],
            mask=w_ok,
            other=0,
            eviction_policy="evict_first" if EVICT_FIRST else "",
        )
        zero = tl.reshape(tl.broadcast_to(zero0[:, :, None], (BLOCK_N, GPS, HALF)), (BLOCK_N, BKB))
        scale = tl.reshape(
            tl.broadcast_to(scale0[:, :, None], (BLOCK_N, GPS, HALF)), (BLOCK_N, BKB)
        )
        w_lo, w_hi = _dequantize(
            _mma_order(packed, BLOCK_N, BKB),
            _mma_order(zero, BLOCK_N, BKB),
            _mma_order(scale, BLOCK_N, BKB),
            MODE,
            ASM,
        )
        # Even columns of x meet the low nibbles, odd ones the high nibbles.
        xv = tl.load(x_rows + col[None, :], mask=x_ok, other=0.0).to(w_lo.dtype)
        x_even, x_odd = tl.split(tl.reshape(xv, (BLOCK_T, BKB, 2)))
        acc = _dot(w_lo, tl.trans(_mma_order(x_even, BLOCK_T, BKB)), acc, MODE)
        acc = _dot(w_hi, tl.trans(_mma_order(x_odd, BLOCK_T, BKB)), acc, MODE)
        zero0, scale0 = zero1, scale1
    # y (bias added, cast), or this split's partial sums (and, for SPLIT_LAST_SUMS, the final sum
    # if this program is the row block's last).
    acc = tl.trans(acc)
    mask = tok_ok[:, None] & row_ok[None, :]
    offs = toks.to(tl.int64)[:, None] * N + rows[None, :]
    if SPLIT == 0:
        _write_y(acc, offs, mask, rows, row_ok, bias_ptr, y_ptr, HAS_BIAS)
    else:
        plane = T.to(tl.int64) * N
        tl.store(partial_ptr + split * plane + offs, acc, mask=mask)
        if SPLIT == 2:
            # Every thread's stores precede the (one-thread, gpu-scope release) arrival.
            tl.debug_barrier()
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == splits - 1:
                total = tl.zeros_like(acc)
                for s in range(splits):  # split order, as `_sum_splits`: deterministic
                    # .cg: read L2, not a stale L1 line of an earlier call.
                    total += tl.load(
                        partial_ptr + s * plane + offs, mask=mask, other=0.0, cache_modifier=".cg"
                    )
                _write_y(total, offs, mask, rows, row_ok, bias_ptr, y_ptr, HAS_BIAS)
                tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next call


@triton.jit(do_not_specialize=["T", "splits"])
def _sum_splits(
    partial_ptr,
    bias_ptr,
    y_ptr,
    T,
    N,
    splits,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    plane = T.to(tl.int64) * N
    mask = offs < plane
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(partial_ptr + s * plane + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# --- the weights-first decode kernel ---------------------------------------------------------


@triton.jit
def _load_step(weights, g0, GPS: tl.constexpr, HALF: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """Groups ``g0 .. g0 + GPS`` of the program's rows (``weights``: ``(packed_ptr, zeros_ptr,
    scales_ptr, rows, row_ok, KB, G)``): packed weight ``[ROWS, GPS * HALF]`` (``HALF`` units a
    group, ``KB`` a row: bytes, or 32-bit words for `_step_half2`) and the groups' zeros and
    scales ``[ROWS, GPS]`` (masked past the row's end: they read nothing). The bytes are one
    2-D tile, columns fastest, so that a thread's 16-byte slice of a row is next to the same
    slice of its other rows (one x value serves them all). ``EVICT_FIRST``: the packed bytes are
    read once a step, so L2 may drop them first (`Plan.evict_first`)."""
    packed_ptr, zeros_ptr, scales_ptr, rows, row_ok, KB, G = weights
    byte = g0 * HALF + tl.arange(0, GPS * HALF)
    r64 = rows.to(tl.int64)
    packed = tl.load(
        packed_ptr + r64[:, None] * KB + byte[None, :],
        mask=row_ok[:, None] & (byte < KB)[None, :],
        other=0,
        eviction_policy="evict_first" if EVICT_FIRST else "",
    )
    g = g0 + tl.arange(0, GPS)
    ok = row_ok[:, None] & (g < G)[None, :]
    zero = tl.load(zeros_ptr + r64[:, None] * G + g[None, :], mask=ok, other=0)
    scale = tl.load(scales_ptr + r64[:, None] * G + g[None, :], mask=ok, other=0.0)
    return packed, zero, scale


@triton.jit
def _per_byte(t, HALF: tl.constexpr):
    """Per-group values ``[R, GPS]`` -> per byte ``[R, GPS * HALF]``."""
    R: tl.constexpr = t.shape[0]
    GPS: tl.constexpr = t.shape[1]
    return tl.reshape(tl.broadcast_to(t[:, :, None], (R, GPS, HALF)), (R, GPS * HALF))


@triton.jit
def _step_fma(
    acc,
    packed,
    zero,
    scale,
    x_ptr,
    K,
    g0,
    TOKENS: tl.constexpr,
    GROUP: tl.constexpr,
    ASM: tl.constexpr,
):
    """``acc [BT, ROWS] +=`` the step's products for tokens ``0 .. TOKENS``, in CUDA cores:
    ``s * sum(x (q - z))`` per group, q - z exact (fp16 asm, or fp32), fp32 FMAs; each weight is
    unpacked once for all the tokens, each group scaled once."""
    ROWS: tl.constexpr = packed.shape[0]
    BKB: tl.constexpr = packed.shape[1]
    GPS: tl.constexpr = zero.shape[1]
    HALF: tl.constexpr = GROUP // 2
    off_lo, off_hi, s = _dequant_terms(zero, scale, 0, ASM)  # the fp16 offsets
    off_lo = _per_byte(off_lo, HALF)
    off_hi = _per_byte(off_hi, HALF)
    if ASM:
        q_lo, q_hi = tl.inline_asm_elementwise(
            _NIBBLES_F16,
            "=r,=r,=r,=r,r,r,r,r,r",
            [packed, off_lo, off_hi],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        q_lo = (packed & 0xF).to(tl.float32) - off_lo
        q_hi = (packed >> 4).to(tl.float32) - off_hi
    # Back in column order (the nibbles of byte j are columns 2j, 2j + 1), to meet x as stored.
    q = tl.reshape(tl.join(q_lo.to(tl.float32), q_hi.to(tl.float32)), (ROWS, 2 * BKB))
    s = s.to(tl.float32)
    col = g0 * GROUP + tl.arange(0, 2 * BKB)
    toks = tl.arange(0, acc.shape[0])
    for t in tl.static_range(TOKENS):
        xv = tl.load(x_ptr + t * K + col, mask=col < K, other=0.0).to(tl.float32)
        # One sum per group: a chain of FMAs per thread, then the threads of a group.
        part = tl.sum(tl.sum(tl.reshape(q * xv[None, :], (ROWS, GPS, GROUP)), axis=2) * s, axis=1)
        acc = tl.where((toks == t)[:, None], acc + part[None, :], acc)
    return acc


# The half2 path of `_int4_rows` (fp16 activations): a 32-bit word of the packed weight (8
# weights: bytes b0..b3, columns 0..7) unpacked into four f16x2 registers of q - z, exact, in
# the lane order (0, 2), (4, 6), (1, 3), (5, 7) that the nibble asm above gives. $4 the word;
# $5, $6 the group's -(1024 + z) and -(64 + z) in both halves. Outputs last: an output may share
# a register with an input.
_WORD_NIBBLES = tl.constexpr(_f16_nibbles(("$5", "$5"), ("$6", "$6"), _UNSCALED))
# x's four column pairs of a word ($4..$7: columns (0, 1), (2, 3), (4, 5), (6, 7), as stored) in
# the weight's lane order, times 1/16 (exact): the fp16 sums below stay far from overflow (four
# products of |q - z| <= 15 reach 65504 only at |x| > 17000).
_X_LANES = tl.constexpr("""
{
.reg .b32 a, b, c, d, s;
mov.b32 s, 0x2C002C00;
prmt.b32 a, $4, $5, 0x5410;
prmt.b32 b, $6, $7, 0x5410;
prmt.b32 c, $4, $5, 0x7632;
prmt.b32 d, $6, $7, 0x7632;
mul.f16x2 $0, a, s;
mul.f16x2 $1, b, s;
mul.f16x2 $2, c, s;
mul.f16x2 $3, d, s;
}
""")
# The 8 products of a word, in f16x2 FMAs (4 products a lane, rounded in fp16), then the two
# lanes added in fp32: $1..$4 the weight's q - z, $5..$8 x in the same lanes.
_WORD_DOT = tl.constexpr("""
{
.reg .b32 a;
.reg .b16 lo, hi;
.reg .f32 f0, f1;
mul.f16x2 a, $1, $5;
fma.rn.f16x2 a, $2, $6, a;
fma.rn.f16x2 a, $3, $7, a;
fma.rn.f16x2 a, $4, $8, a;
mov.b32 {lo, hi}, a;
cvt.f32.f16 f0, lo;
cvt.f32.f16 f1, hi;
add.f32 $0, f0, f1;
}
""")


@triton.jit
def _f16x2_of(v):
    """fp32 values -> int32 holding the fp16 value in both halves."""
    bits = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return bits | (bits << 16)


@triton.jit
def _step_half2(acc, words, zero, scale, x_ptr, KB, g0, TOKENS: tl.constexpr, GROUP: tl.constexpr):
    """`_step_fma` for fp16 x on packed 32-bit words (``words [ROWS, GPS * GROUP / 8]``, x as
    int32 column pairs, row stride ``KB``): each weight unpacked once, its products in f16x2 FMAs
    (two products an instruction) and 4 of them summed in fp16 before fp32 takes over, so that a
    token costs fewer instructions per weight than `_step_fma`'s fp32 FMAs. The fp16 sums of
    four rounded products are further from the reference than the fp32 path (the tests bound
    both; docs/gpu-kernels.md, "Half2 products and an L2 prefetch")."""
    ROWS: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    GPS: tl.constexpr = zero.shape[1]
    WPG: tl.constexpr = GROUP // 8
    z = zero.to(tl.float32)
    off_lo = _per_byte(_f16x2_of(-1024.0 - z), WPG)
    off_hi = _per_byte(_f16x2_of(-64.0 - z), WPG)
    l0, l1, h0, h1 = tl.inline_asm_elementwise(
        _WORD_NIBBLES,
        "=r,=r,=r,=r,r,r,r",
        [words, off_lo, off_hi],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )
    s = scale.to(tl.float32) * 16.0  # x was taken times 1/16
    pair = (g0 * WPG + tl.arange(0, W))[:, None] * 4 + tl.arange(0, 4)[None, :]
    toks = tl.arange(0, acc.shape[0])
    for t in tl.static_range(TOKENS):
        xp = tl.load(x_ptr + t * KB + pair, mask=pair < KB, other=0)  # [W, 4] int32
        even, odd = tl.split(tl.reshape(xp, (W, 2, 2)))  # pairs (0, 2) and (1, 3)
        p0, p2 = tl.split(even)
        p1, p3 = tl.split(odd)
        xa, xb, xc, xd = tl.inline_asm_elementwise(
            _X_LANES,
            "=r,=r,=r,=r,r,r,r,r",
            [p0, p1, p2, p3],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
        dots = tl.inline_asm_elementwise(
            _WORD_DOT,
            "=f,r,r,r,r,r,r,r,r",
            [l0, l1, h0, h1, xa[None, :], xb[None, :], xc[None, :], xd[None, :]],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
        part = tl.sum(tl.sum(tl.reshape(dots, (ROWS, GPS, WPG)), axis=2) * s, axis=1)
        acc = tl.where((toks == t)[:, None], acc + part[None, :], acc)
    return acc


@triton.jit
def _step_sum(
    acc,
    packed,
    zero,
    scale,
    x_ptr,
    K,
    KB,
    g0,
    TOKENS: tl.constexpr,
    GROUP: tl.constexpr,
    ASM: tl.constexpr,
    HALF2: tl.constexpr,
):
    if HALF2:
        acc = _step_half2(acc, packed, zero, scale, x_ptr, KB, g0, TOKENS, GROUP)
    else:
        acc = _step_fma(acc, packed, zero, scale, x_ptr, K, g0, TOKENS, GROUP, ASM)
    return acc


@triton.jit(do_not_specialize=["T"])
def _int4_rows(
    x_ptr,
    packed_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    y_ptr,
    T,
    N,
    K,
    KB,
    G,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    GPS: tl.constexpr,
    STEPS: tl.constexpr,
    GB: tl.constexpr,
    GC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TOKENS: tl.constexpr,
    ASM: tl.constexpr,
    HALF2: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    """``ROWS`` whole rows of ``TOKENS`` tokens. A row's groups are either ``STEPS`` steps of
    ``GPS`` groups, or (``STEPS == 0``) up to three power-of-two pieces of ``GPS``, ``GB``,
    ``GC`` groups (`row_pieces`), all of them loaded before the wait. ``packed_ptr``: the packed
    weight, bytes, or with ``HALF2`` 32-bit words (and x then comes as int32 pairs of fp16
    columns: `_step_half2`)."""
    # Units of the packed weight per group, and its row stride in them: bytes, or words.
    PER: tl.constexpr = GROUP // 8 if HALF2 else GROUP // 2
    WS = KB // 4 if HALF2 else KB
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N
    weights = (packed_ptr, zeros_ptr, scales_ptr, rows, row_ok, WS, G)
    acc = tl.zeros((BLOCK_T, ROWS), dtype=tl.float32)
    # The weights are constants (trtc.plugins.kernels.pdl): they are requested before the wait
    # for the previous kernel, so they stream while it finishes: the whole row, or the first step
    # (each later step's are requested one step ahead, into registers).
    pa, za, sa = _load_step(weights, 0, GPS, PER, EVICT_FIRST)
    if STEPS == 0:
        if GB > 0:
            pb, zb, sb = _load_step(weights, GPS, GB, PER, EVICT_FIRST)
        if GC > 0:
            pc, zc, sc = _load_step(weights, GPS + GB, GC, PER, EVICT_FIRST)
        pdl.begin(PDL)
        acc = _step_sum(acc, pa, za, sa, x_ptr, K, KB, 0, TOKENS, GROUP, ASM, HALF2)
        if GB > 0:
            acc = _step_sum(acc, pb, zb, sb, x_ptr, K, KB, GPS, TOKENS, GROUP, ASM, HALF2)
        if GC > 0:
            acc = _step_sum(acc, pc, zc, sc, x_ptr, K, KB, GPS + GB, TOKENS, GROUP, ASM, HALF2)
    elif STEPS <= 8:
        # Few steps are unrolled: a loop would carry the packed bytes in one register each
        # (and repack them for the asm every step). Each step requests the next step's weights
        # (past the last step the masks are all off: nothing is read), then reduces its own.
        pdl.begin(PDL)
        for i in tl.static_range(STEPS):
            pn, zn, sn = _load_step(weights, i * GPS + GPS, GPS, PER, EVICT_FIRST)
            acc = _step_sum(acc, pa, za, sa, x_ptr, K, KB, i * GPS, TOKENS, GROUP, ASM, HALF2)
            pa, za, sa = pn, zn, sn
    else:
        pdl.begin(PDL)
        for i in range(STEPS):
            pn, zn, sn = _load_step(weights, i * GPS + GPS, GPS, PER, EVICT_FIRST)
            acc = _step_sum(acc, pa, za, sa, x_ptr, K, KB, i * GPS, TOKENS, GROUP, ASM, HALF2)
            pa, za, sa = pn, zn, sn
    toks = tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    mask = tok_ok[:, None] & row_ok[None, :]
    _write_y(
        acc,
        toks.to(tl.int64)[:, None] * N + rows[None, :],
        mask,
        rows,
        row_ok,
        bias_ptr,
        y_ptr,
        HAS_BIAS,
    )


# --- launch ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How one Int4Gemm call is launched. ``kernel`` "split": `_int4_dot`, ``block_t`` tokens x
    ``block_n`` output rows per program (both >= 16: the dot's tile), ``block_k`` columns per
    loop step (a multiple of 128 and of the group size); ``split_k`` programs share a row
    block's K range and ``reduce`` ("kernel" | "last") says who adds their partial sums.
    ``kernel`` "rows": `_int4_rows` (decode, at most `ROWS_MAX_TOKENS` tokens), ``block_n``
    whole rows per program (a power of two), ``block_k`` columns per step (rounded up to a
    power of two number of groups; the whole row, loaded before the wait, when it covers K);
    ``block_t``, ``split_k`` and ``reduce`` unused. ``max_registers`` caps the registers of a
    thread (so that a given number of programs fits on an SM; None: the compiler's choice).
    ``prefetch`` (split kernel, on GPUs with bulk prefetches: sm_90 and later): each program
    first asks L2 for its whole slice of the packed weight, before the wait for the previous
    kernel. ``half2`` (rows kernel, fp16 activations, K a multiple of 8): products in packed
    f16x2 FMAs (`_step_half2`) instead of fp32 ones. ``evict_first``: the packed
    weight is loaded with L2's evict-first policy (a weight is read once a step; the
    activations, KV cache and the other kernels' data are what L2 should keep)."""

    block_t: int
    block_n: int
    split_k: int = 1
    reduce: str = "kernel"
    num_warps: int = 4
    num_stages: int = 3
    block_k: int = 256
    max_registers: int | None = None
    kernel: str = "split"
    prefetch: bool = False
    half2: bool = False
    evict_first: bool = False


# Tokens `_int4_rows` takes (each is one more pass of FMAs over the unpacked weights).
ROWS_MAX_TOKENS = 8


def row_pieces(groups: int) -> tuple[int, int, int]:
    """A whole row's ``groups`` as `_int4_rows` loads them: up to three powers of two (a tile's
    size must be one): the largest that fits, the largest that fits in the rest, the rest
    rounded up (its padding is masked: it reads nothing). 86 groups (K = 11008, group 128):
    64 + 16 + 8."""
    a = 1 << (groups.bit_length() - 1)
    rest = groups - a
    b = 1 << (rest.bit_length() - 1) if rest else 0
    rest -= b
    return a, b, triton.next_power_of_2(rest) if rest else 0


def supports(group_size: int) -> bool:
    """Group sizes the kernels take: powers of two 32..256 (a dot's K is at least 16; both
    nibbles of a byte, and a 32-bit word's 8, share a group). Others run the reference."""
    return 32 <= group_size <= 256 and group_size & (group_size - 1) == 0


def split_k_for(tiles: int, steps: int, slots: int, tokens: int, k: int, min_steps: int = 2) -> int:
    """K splits for a decode launch of ``tiles`` row blocks: as many as fill ``slots`` programs
    (the programs the SMs hold at once: one wave), keeping at least
    ``min_steps`` loop steps per split (shorter splits spend more on partial sums and loop
    ramp-up than they gain) and the fp32 partial sums (``split * T * N * 4`` bytes, written
    then read) under a quarter of the packed weight (``N * K / 2``): ``K / (32 T)`` splits."""
    most = max(1, min(steps // min_steps, k // (32 * tokens)))
    return max(1, min(slots // tiles, most))


def block_k_for(k: int, group_size: int) -> int:
    """Columns per loop step: whole groups, a multiple of 128 (the dot's column order works on
    64-byte blocks), 256 where it divides K (128 contiguous bytes of each row per step)."""
    base = 256 if k % 256 == 0 or k % 128 else 128
    return max(base, group_size)


def split_plan(tokens: int, n: int, k: int, group_size: int, sm_count: int = 132) -> Plan:
    """The launch of the split-K dot kernel `_int4_dot` for ``[tokens, k] @ [n, k].T``: the
    fastest of the alternatives that benchmarks/int4_gemm.py times (docs/gpu-kernels.md,
    "Int4Gemm")."""
    block_k = block_k_for(k, group_size)
    if tokens <= 16:
        # Decode (memory-bound): 1..16 tokens are one 16-wide tile; 64 rows per program (one
        # warpgroup; its registers leave room for three programs per SM), 256 columns (128
        # contiguous bytes of each row) per step. K is split until the programs fill the SMs
        # once; the last program of a row block adds the partial sums (one launch). 128-row
        # programs (two warpgroups, two per SM) and 128-column steps were slower.
        # Layers of at most 4096 x 4096 prefetch each program's slice into L2 before the wait
        # (it pays there, and costs time on the larger layers).
        split = split_k_for(-(-n // 64), -(-k // block_k), 3 * sm_count, tokens, k)
        return Plan(
            16,
            64,
            split,
            reduce="last",
            num_warps=4,
            num_stages=3,
            block_k=block_k,
            prefetch=n * k <= 4096 * 4096,
        )
    # Prefill (compute-bound): 64 tokens x 128 rows, one group (128 columns) per step (faster
    # than 128 x 128 tiles with 8 warps).
    return Plan(64, 128, 1, num_warps=4, num_stages=3, block_k=max(128, group_size))


def default_plan(
    tokens: int, n: int, k: int, group_size: int, sm_count: int = 132, fp16: bool = True
) -> Plan:
    """The launch for ``[tokens, k] @ [n, k].T``: the fastest of the alternatives that
    benchmarks/int4_gemm.py times (docs/gpu-kernels.md, "Weights-first decode kernel", "Half2
    products and an L2 prefetch", "The read ceiling, and evict-first weights"). ``fp16``: the
    activations are fp16 (the rows kernel's half2 products; bf16 and fp32 take its fp32
    ones)."""
    if tokens == 1:
        # The weights-first kernel, 8 rows a program, the whole row loaded before the wait, half2
        # products (fp32 products and the split kernel are slower at one token). 4 warps where a
        # row is one 2048-byte piece, 8 for the 5.5 KB rows of K = 11008. The packed weight is
        # loaded evict-first in every rows plan: it is read once, L2 should keep the rest.
        return Plan(
            16,
            8,
            kernel="rows",
            num_warps=4 if k <= 4096 else 8,
            num_stages=1,
            block_k=triton.next_power_of_2(k),
            half2=fp16,
            evict_first=True,
        )
    if tokens == 2 and fp16 and k <= 4096:
        # Half2 products make a second token cheap enough on short rows (the split kernel stays
        # the faster one on long rows, K = 11008).
        return Plan(
            16,
            4,
            kernel="rows",
            num_warps=4,
            num_stages=1,
            block_k=triton.next_power_of_2(k),
            half2=True,
            evict_first=True,
        )
    if tokens == 2 and n * k <= 4096 * 4096:
        # fp32 products (bf16): faster only where the split kernel's fixed cost is most of its
        # time (small layers).
        return Plan(16, 4, kernel="rows", num_warps=4, num_stages=1, block_k=2048, evict_first=True)
    return split_plan(tokens, n, k, group_size, sm_count)


@functools.cache
def _bulk_prefetch_on(device_index: int) -> bool:
    return has_feature(device_index, "bulk_prefetch")


def _has_bulk_prefetch(device: torch.device) -> bool:
    """``cp.async.bulk.prefetch.L2`` needs sm_90 or later."""
    return _bulk_prefetch_on(
        device.index if device.index is not None else torch.cuda.current_device()
    )


def _interpreting() -> bool:
    """Triton's CPU interpreter runs no inline PTX: the dot kernel then dequantizes in portable
    ops."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_mode(x: torch.Tensor) -> int:
    if x.dtype == torch.float16:
        return FP16
    if x.dtype == torch.bfloat16 and x.is_cuda:
        return BF16
    return FP32


def check_plan(plan: Plan, tokens: int) -> None:
    if plan.kernel == "split":
        if (
            plan.reduce not in ("kernel", "last")
            or plan.split_k < 1
            or min(plan.block_t, plan.block_n) < 16
            or plan.block_k % 128
        ):
            raise ValueError(
                f"Int4Gemm plan {plan}: reduce kernel | last, split_k >= 1, block_t "
                f"and block_n >= 16, block_k a multiple of 128"
            )
        return
    where = f"Int4Gemm plan {plan} for {tokens} tokens"
    if plan.kernel != "rows":
        raise ValueError(f"{where}: kernel must be split | rows")
    if plan.block_n < 1 or plan.block_n & (plan.block_n - 1):
        raise ValueError(f"{where}: the rows kernel takes block_n a power of two")
    if tokens > ROWS_MAX_TOKENS:
        raise ValueError(f"{where}: the rows kernel takes at most {ROWS_MAX_TOKENS} tokens")


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group_size: int,
    in_features: int,
    out_features: int,
    plan: Plan | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [..., N] = x @ dequantize(W).T + bias`` (shapes as `reference.check_shapes` accepts
    them, ``supports(group_size)``); ``plan`` overrides `default_plan` (the benchmark's
    variants). ``out`` (contiguous ``[T, N]`` in x's dtype) and ``workspace`` (contiguous fp32,
    at least ``split_k * T * N`` elements) are used instead of allocating them when given."""
    k, n = in_features, out_features
    x2 = x.reshape(-1, k).contiguous()
    tokens = x2.shape[0]
    y = out if out is not None else torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if tuple(y.shape) != (tokens, n) or y.dtype != x.dtype or not y.is_contiguous():
        raise ValueError(
            f"Int4Gemm: out must be a contiguous {x.dtype} [{tokens}, {n}], got "
            f"{y.dtype} {list(y.shape)}"
        )
    if tokens == 0 or n == 0:
        return y.view(*x.shape[:-1], n)
    groups = scales.shape[1]
    mode = _dot_mode(x)
    if plan is None:
        plan = default_plan(tokens, n, k, group_size, sm_count(x.device), fp16=mode == FP16)
    check_plan(plan, tokens)
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    bias_arg = bias.contiguous() if bias is not None else scales  # unread when HAS_BIAS is off
    asm = mode != FP32 and not _interpreting()
    launch = dict(num_warps=plan.num_warps, num_stages=plan.num_stages)
    if plan.max_registers:
        launch["maxnreg"] = plan.max_registers
    # PDL (trtc.plugins.kernels.pdl) for decode launches only: prefill launches are slower with it
    # (docs/gpu-kernels.md, "Programmatic dependent launch"; presumably their programs, placed
    # while the previous kernel still holds the SMs, are spread unevenly).
    pdl_launch = pdl.launch_options(x.device) if tokens <= 16 else {"PDL": False}
    launch.update(pdl_launch)
    # K/2 is passed on its own (both kernels) so that Triton sees the row stride's divisibility
    # by 16 (16-byte weight loads); derived in the kernel from K it is only known to be even.
    if plan.kernel == "rows":
        gps = triton.next_power_of_2(max(1, plan.block_k // group_size))
        steps, gb, gc = triton.cdiv(groups, gps), 0, 0
        if gps * group_size >= k:
            (gps, gb, gc), steps = row_pieces(groups), 0
        # The half2 path reads 32-bit words: whole words per row, aligned.
        half2 = (
            plan.half2
            and asm
            and mode == FP16
            and k % 8 == 0
            and qweight.data_ptr() % 4 == 0
            and x2.data_ptr() % 4 == 0
        )
        _int4_rows[(triton.cdiv(n, plan.block_n),)](
            x2.view(torch.int32) if half2 else x2,
            qweight.view(torch.int32) if half2 else qweight,
            scales,
            zeros,
            bias_arg,
            y,
            tokens,
            n,
            k,
            k // 2,
            groups,
            GROUP=group_size,
            ROWS=plan.block_n,
            GPS=gps,
            STEPS=steps,
            GB=gb,
            GC=gc,
            BLOCK_T=triton.next_power_of_2(tokens),
            TOKENS=tokens,
            ASM=asm,
            HALF2=half2,
            HAS_BIAS=bias is not None,
            EVICT_FIRST=plan.evict_first,
            **launch,
        )
        return y.view(*x.shape[:-1], n)
    block_k = max(plan.block_k, group_size)
    split = NO_SPLIT
    partial = y
    counters = y
    tiles = triton.cdiv(tokens, plan.block_t) * triton.cdiv(n, plan.block_n)
    if plan.split_k > 1:
        split = SPLIT_LAST_SUMS if plan.reduce == "last" else SPLIT_THEN_KERNEL
        partial = (
            workspace
            if workspace is not None
            else torch.empty(plan.split_k * tokens * n, dtype=torch.float32, device=x.device)
        )
        if (
            partial.dtype != torch.float32
            or not partial.is_contiguous()
            or partial.numel() < plan.split_k * tokens * n
        ):
            raise ValueError(
                f"Int4Gemm: workspace must be contiguous fp32 with at least "
                f"{plan.split_k * tokens * n} elements"
            )
        if split == SPLIT_LAST_SUMS:
            counters = arrival_counters(x.device, tiles)
    grid = (tiles, plan.split_k)
    steps = triton.cdiv(k, block_k)
    prefetch = (
        plan.prefetch
        and asm
        and _has_bulk_prefetch(x.device)
        and (k // 2) % 16 == 0
        and qweight.data_ptr() % 16 == 0
    )
    _int4_dot[grid](
        x2,
        qweight,
        scales,
        zeros,
        bias_arg,
        y,
        partial,
        counters,
        tokens,
        n,
        k,
        k // 2,
        groups,
        -(-steps // plan.split_k),
        plan.split_k,
        GROUP=group_size,
        BLOCK_T=plan.block_t,
        BLOCK_N=plan.block_n,
        BLOCK_K=block_k,
        MODE=mode,
        ASM=asm,
        EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None,
        SPLIT=split,
        PREFETCH=prefetch,
        EVICT_FIRST=plan.evict_first,
        **launch,
    )
    if split == SPLIT_THEN_KERNEL:
        block = 1024
        _sum_splits[(triton.cdiv(tokens * n, block),)](
            partial,
            bias_arg,
            y,
            tokens,
            n,
            plan.split_k,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            **pdl_launch,
        )
    return y.view(*x.shape[:-1], n)
