"""`trtc::PagedAttention` in Triton: the CUDA implementation (the TensorRT plugin calls the same
kernels). Semantics are the reference's (`reference.py`); tests compare the two.

Kernels:

* `_write_kv`: one program per token scatters its new K/V rows into their cache slots.
* `_paged_attention`: one program per (query tile, KV head, context split). A query tile is up to
  ``TILE_Q`` consecutive new tokens of one sequence times the ``GROUP`` query heads that share the
  KV head (GQA packing: each K/V tile is loaded once for all of them). The program walks the
  sequence's context in ``TILE_K``-position tiles through the block table with an online softmax.
  For decode (one token per sequence) the context is split across ``num_splits`` programs so that
  a batch of long sequences fills the GPU; the partial results are merged by the last split
  of each group to finish (up to 4 splits) or by `_combine` (more splits).

Which sequence a query tile belongs to is found in the kernel by a binary search over
``query_start_loc``, so the launch depends only on tensor shapes, never on their values: the step
can be captured in a CUDA graph. All three launch with programmatic dependent launch where the GPU
has it (`trtc.plugins.kernels.pdl`). `_write_kv` and `_combine` wait first (all they read an
earlier kernel may write); `_paged_attention` reads the step's inputs and, for one-token queries,
its first tile of the K/V earlier steps wrote before it waits: at batch 1 the attention of a short
context is then mostly the wait, the query load and two small products. That read holds because a
step writes only its new tokens' slots: blocks shared through the prefix cache are full and never
written, a prompt's last token is never in a shared block (the prefix lookup stops one token
short), a block joins the prefix cache only after its step, and padding rows have slot -1. A
step that copied or wrote other cache rows on the GPU would have to end that read.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from trtc.gpu_profiles import DEFAULT_SM_COUNT, sm_count
from trtc.plugins.kernels import pdl
from trtc.plugins.kernels.arrival_counters import arrival_counters
from trtc.plugins.paged_attention import SPEC
from trtc.plugins.paged_attention.reference import check_scales


@triton.jit
def round_to_e4m3(y):
    """fp32 ``y`` -> the nearest E4M3 value (ties to even, saturated at +-448), held exactly in
    fp32 and computed with exact fp32 operations only (power-of-two multiplies, one rounding
    add). Spelled out because Triton's CPU interpreter's cast drops the carry into the next power
    of two (1.97 -> 1.0). The value returned is on the grid, so the cast that follows is exact on
    any backend, and interpreter and GPU both store torch's bytes."""
    y = tl.clamp(y, -448.0, 448.0)
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(exponent, -6) - 3  # E4M3 spacing 2^e (subnormals: 2^-9)
    step = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - e) << 23).to(tl.float32, bitcast=True)
    v = y * inv_step  # exact; |v| < 16
    r = (v + 12582912.0) - 12582912.0  # + 1.5 * 2^23: rounds half to even
    return tl.where(r == 0.0, y * 0.0, r * step)  # y * 0 keeps the sign of zero


@triton.jit
def to_cache(x, scale, ty: tl.constexpr, FP8: tl.constexpr):
    """The reference's `to_cache`, as the cache dtype ``ty``: an FP8 cache holds x / scale,
    saturated at +-448 and rounded to nearest even (`round_to_e4m3`; the division IEEE-rounded,
    as Triton's ``/`` on fp32 is the approximate ``div.full.f32``); other caches hold x."""
    if FP8:
        y = round_to_e4m3(tl.math.div_rn(x.to(tl.float32), scale)).to(ty)
    else:
        y = x.to(ty)
    return y


@triton.jit
def _write_kv(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    cache_kv_stride,
    k_scale,
    v_scale,
    ROW: tl.constexpr,
    ROW_P2: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        cols = tl.arange(0, ROW_P2)
        mask = cols < ROW
        ty = cache_ptr.dtype.element_ty
        k = to_cache(tl.load(key_ptr + token * ROW + cols, mask=mask), k_scale, ty, FP8)
        v = to_cache(tl.load(value_ptr + token * ROW + cols, mask=mask), v_scale, ty, FP8)
        dst = cache_ptr + slot.to(tl.int64) * ROW + cols
        tl.store(dst, k, mask=mask)
        tl.store(dst + cache_kv_stride, v, mask=mask)


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, TILE_Q: tl.constexpr):
    """The sequence whose query tiles include global tile ``tile`` (tile numbering: sequence s
    owns tiles ``qsl[s] // TILE_Q + s`` onwards, which never overlap)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // TILE_Q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


def merge_chunk(tile_m: int, head_dim_p2: int) -> int:
    """Splits whose ``[TILE_M, D]`` fp32 partial outputs the merging program loads at once
    (`_paged_attention`, MERGE_LAST): four at 16 x 64 (the 1.1B model's decode tile, as timed),
    fewer for larger tiles, whose four loads would not fit in a thread's registers (at 32 x 128,
    multi-query, they spilled on sm_90)."""
    return max(1, min(4, 4096 // (tile_m * head_dim_p2)))


@triton.jit
def _slot(table, pos, pos_ok, BLOCK_SIZE):
    """The cache slots of positions ``pos`` through the sequence's block table (block 0's where
    not ``pos_ok``)."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    return block * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def _load_tile(cache_ptr, cache_kv_stride, table, pos, end, kv_head, dims, BLOCK_SIZE, KV, D):
    """``(k, v, pos_ok)``: the K and V rows of KV head ``kv_head`` (``KV`` heads of ``D``
    dimensions a slot) at positions ``pos`` (those before ``end``; zeros elsewhere) of the paged
    cache, through the sequence's block table."""
    pos_ok = pos < end
    slot = _slot(table, pos, pos_ok, BLOCK_SIZE)
    addr = (slot[:, None] * KV + kv_head) * D + dims[None, :]
    mask = pos_ok[:, None] & (dims < D)[None, :]
    k = tl.load(cache_ptr + addr, mask=mask, other=0.0)
    v = tl.load(cache_ptr + cache_kv_stride + addr, mask=mask, other=0.0)
    return k, v, pos_ok


@triton.jit
def _attend_tile(
    q, k, v, pos, pos_ok, row_pos, sliding_window, scale, m_i, l_i, acc, DOT_PRECISION
):
    """One K/V tile of the online softmax: the running max ``m_i``, sum ``l_i`` and output
    ``acc`` of the query rows after the positions ``pos`` (a causal and windowed view)."""
    # In the query's dtype: exact for an FP8 cache (every E4M3 value is an fp16/bf16 value).
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    visible = pos_ok[None, :] & (pos[None, :] <= row_pos[:, None])
    if sliding_window > 0:
        visible &= pos[None, :] > row_pos[:, None] - sliding_window
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION).to(
        tl.float32
    )
    return m_new, l_i, acc


@triton.jit
def _attend_one(q, k, v, scale, m_i, l_i, acc):
    """The online softmax after one more position that every query row sees (a decode token's
    own): its score a row-wise dot in fp32, its weight rounded to the query dtype as
    `_attend_tile`'s product rounds it."""
    k = k.to(q.dtype).to(tl.float32)
    v = v.to(q.dtype).to(tl.float32)
    s = tl.sum(q.to(tl.float32) * k[None, :], 1) * scale
    m_new = tl.maximum(m_i, s)
    p = tl.exp(s - m_new)
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * v[None, :]
    return m_new, l_i, acc


@triton.jit
def _paged_attention(
    q_ptr,
    cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    counter_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    max_blocks,
    cache_kv_stride,
    scale,
    v_scale,
    sliding_window,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_Q: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DECODE: tl.constexpr,
    SEQS: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    MERGE_LAST: tl.constexpr,
    PREFETCH: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    # Everything up to `pdl.begin` reads only the step's inputs (block tables, lengths, query
    # starts: copied in before the step's first kernel) and, with PREFETCH, the K/V that earlier
    # steps wrote: no kernel of this step writes them, so they are read before the wait for the
    # kernel before (the module docstring). A program with nothing to do waits too before it
    # returns: a launch whose programs all returned early would otherwise complete before the
    # kernel ahead of it, and the kernel after, waiting only for this one, would not see it.
    # HEADS_FIRST: the KV heads of one (tile, split) are neighbouring programs, so the rows of a
    # cache block (all KV heads of a position side by side) are read at about the same time.
    tile = tl.program_id(1 if HEADS_FIRST else 0)
    kv_head = tl.program_id(0 if HEADS_FIRST else 1)
    split = tl.program_id(2)
    if DECODE:
        # One token per sequence: tile = sequence, no search, no spare tiles.
        seq = tile
        if SEQS == 1:
            # A mixed step's one-token sequences; its longer ones are the SEQS == 2 launch's.
            q_begin = tl.load(query_start_loc_ptr + seq)
            q_end = tl.load(query_start_loc_ptr + seq + 1)
            if q_end - q_begin != 1:
                pdl.begin(PDL)  # every program waits (`trtc.plugins.kernels.pdl`)
                return
        else:  # a decode step (T == S): token = sequence
            q_begin = tile
            q_end = tile + 1
        q_start = q_begin
    else:
        seq = _find_seq(query_start_loc_ptr, tile, num_seqs, TILE_Q)
        q_begin = tl.load(query_start_loc_ptr + seq)
        q_end = tl.load(query_start_loc_ptr + seq + 1)
        first_tile = q_begin // TILE_Q + seq
        q_start = q_begin + (tile - first_tile) * TILE_Q  # first token of this tile
        if q_start >= q_end:
            pdl.begin(PDL)
            return  # a spare tile of this sequence
        if SEQS == 2 and q_end - q_begin == 1:
            pdl.begin(PDL)
            return  # a one-token sequence: the SEQS == 1 launch's
    context_len = tl.load(context_lens_ptr + seq)
    num_new = q_end - q_begin

    # Rows: TILE_Q tokens x GROUP heads (row r = token r // GROUP, head r % GROUP), padded to
    # TILE_M.
    rows = tl.arange(0, TILE_M)
    row_token = q_start + rows // GROUP
    row_head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < TILE_Q * GROUP) & (row_token < q_end)
    row_pos = context_len - num_new + (row_token - q_begin)  # absolute position of each query
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    KV: tl.constexpr = NUM_KV_HEADS  # short names for the cache addresses below
    D: tl.constexpr = HEAD_DIM

    # Keys this tile may see: up to the last query's position, from the first query's window.
    last_pos = tl.minimum(context_len - num_new + (q_start - q_begin) + TILE_Q, context_len)
    first_pos = 0
    if sliding_window > 0:
        first_pos = tl.maximum(context_len - num_new + (q_start - q_begin) - sliding_window + 1, 0)
        first_pos = (first_pos // TILE_K) * TILE_K
    span = last_pos - first_pos
    per_split = tl.cdiv(tl.cdiv(span, TILE_K), NUM_SPLITS) * TILE_K
    k_begin = first_pos + split * per_split
    k_end = tl.minimum(k_begin + per_split, last_pos)

    m_i = tl.full([TILE_M], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_M], tl.float32)
    acc = tl.zeros([TILE_M, HEAD_DIM_P2], tl.float32)
    offs_k = tl.arange(0, TILE_K)
    table = block_tables_ptr + seq.to(tl.int64) * max_blocks
    loop_begin = k_begin
    loop_end = k_end
    if PREFETCH:
        # One new token (DECODE): the tiles hold the positions earlier steps wrote, and the
        # split that holds the token's own position adds it after the tiles (`_attend_one`).
        # The first tile is read before the wait; at a short context that is the split's whole
        # read, off the critical path.
        new_pos = tl.maximum(context_len - 1, 0)  # (a context of 0 has no new position)
        loop_end = tl.minimum(k_end, new_pos)
        pos0 = k_begin + offs_k
        k0, v0, pos0_ok = _load_tile(
            cache_ptr, cache_kv_stride, table, pos0, loop_end, kv_head, dims, BLOCK_SIZE, KV, D
        )
        has_new = (k_begin <= new_pos) & (new_pos < k_end)
        new_slot = _slot(table, new_pos, has_new, BLOCK_SIZE)
        new_addr = (new_slot * KV + kv_head) * D + dims
    pdl.begin(PDL)
    q = tl.load(
        q_ptr + (row_token[:, None] * NUM_HEADS + row_head[:, None]) * HEAD_DIM + dims[None, :],
        mask=row_valid[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if PREFETCH:
        # The new token's own K/V (the q/k/v kernel's write) in the same round trip as q; a
        # split without it reads a slot of block 0 (in bounds) and leaves it unused.
        k_new = tl.load(cache_ptr + new_addr, mask=dim_ok, other=0.0)
        v_new = tl.load(cache_ptr + cache_kv_stride + new_addr, mask=dim_ok, other=0.0)
        m_i, l_i, acc = _attend_tile(
            q, k0, v0, pos0, pos0_ok, row_pos, sliding_window, scale, m_i, l_i, acc, DOT_PRECISION
        )
        loop_begin = k_begin + TILE_K
    for start in range(loop_begin, loop_end, TILE_K):
        pos = start + offs_k
        k, v, pos_ok = _load_tile(
            cache_ptr, cache_kv_stride, table, pos, loop_end, kv_head, dims, BLOCK_SIZE, KV, D
        )
        m_i, l_i, acc = _attend_tile(
            q, k, v, pos, pos_ok, row_pos, sliding_window, scale, m_i, l_i, acc, DOT_PRECISION
        )
    if PREFETCH:
        if has_new:
            m_i, l_i, acc = _attend_one(q, k_new, v_new, scale, m_i, l_i, acc)

    acc = acc * v_scale  # an FP8 cache's V scale (else 1)
    out_rows = row_token[:, None] * NUM_HEADS + row_head[:, None]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + out_rows * HEAD_DIM + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_ok[None, :],
        )
    else:
        part = (row_token * NUM_HEADS + row_head) * NUM_SPLITS + split
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM_P2 + dims[None, :],
            acc,
            mask=row_valid[:, None] & (dims[None, :] < HEAD_DIM_P2),
        )
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_valid)
        if MERGE_LAST:
            # The last split of this (tile, KV head) to finish merges them all (no second launch;
            # see plugins/kernels/arrival_counters.py). Every thread's stores precede the arrival.
            tl.debug_barrier()
            group = tile * NUM_KV_HEADS + kv_head
            arrived = tl.atomic_add(counter_ptr + group, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:
                first = (row_token * NUM_HEADS + row_head) * NUM_SPLITS
                out_mask = row_valid[:, None] & dim_ok[None, :]
                # Only the splits that had positions to read: a short context leaves the rest
                # empty (nothing in them to merge), and each chunk of partial outputs read is a
                # round trip.
                used = tl.minimum(tl.cdiv(span, per_split), NUM_SPLITS)
                # Every split's running max and sum in one round trip ([rows, splits]); .cg:
                # read L2, not a stale L1 line of an earlier launch.
                splits = tl.arange(0, NUM_SPLITS)
                ml_at = part_ml_ptr + (first[:, None] + splits[None, :]) * 2
                ml_ok = row_valid[:, None] & (splits < used)[None, :]
                m_s = tl.load(ml_at, mask=ml_ok, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(ml_at + 1, mask=ml_ok, other=0.0, cache_modifier=".cg")
                m_max = tl.max(m_s, 1)
                m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
                w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_max[:, None]))
                total = tl.sum(w * l_s, 1)
                merged = tl.zeros([TILE_M, HEAD_DIM_P2], tl.float32)
                # The partial outputs MERGE_CHUNK splits at a time (their loads issue together),
                # in split order, as `_combine`.
                for c in tl.static_range(0, NUM_SPLITS, MERGE_CHUNK):
                    if c < used:
                        for j in tl.static_range(MERGE_CHUNK):
                            part = first + c + j
                            a_s = tl.load(
                                part_acc_ptr + part[:, None] * HEAD_DIM_P2 + dims[None, :],
                                # (a [rows] vector: Triton's interpreter takes no scalar here)
                                mask=out_mask & (rows * 0 + c + j < used)[:, None],
                                other=0.0,
                                cache_modifier=".cg",
                            )
                            w_s = tl.sum(tl.where(splits[None, :] == c + j, w, 0.0), 1)
                            merged += a_s * w_s[:, None]
                out = merged / tl.where(total == 0.0, 1.0, total)[:, None]
                tl.store(
                    out_ptr + out_rows * HEAD_DIM + dims[None, :],
                    out.to(out_ptr.dtype.element_ty),
                    mask=out_mask,
                )
                tl.atomic_xchg(counter_ptr + group, 0)  # ready for the next launch


@triton.jit
def _combine(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the splits of one (token, head) row: softmax-weighted sum of the partial results."""
    pdl.begin(PDL)
    row = tl.program_id(0)
    splits = tl.arange(0, NUM_SPLITS)
    m_s = tl.load(part_ml_ptr + (row * NUM_SPLITS + splits) * 2)
    l_s = tl.load(part_ml_ptr + (row * NUM_SPLITS + splits) * 2 + 1)
    m_max = tl.max(m_s, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_max))
    dims = tl.arange(0, HEAD_DIM_P2)
    acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM_P2 + dims[None, :])
    total = tl.sum(w * l_s, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM
    )


MERGE_LAST_MAX_SPLITS = 4


def merges_last(splits: int, merge: str) -> bool:
    """Whether the last split of each group merges a launch's partial results (no `_combine`
    launch). ``merge``: "last", "kernel" (`_combine` does) or "auto": "last" up to
    MERGE_LAST_MAX_SPLITS splits, where the last program's reads of the partials cost less than
    a second launch (docs/gpu-kernels.md, "Merging the splits in the kernel" and "The in-kernel
    merge again, with the early read")."""
    return splits > 1 and (merge == "last" or (merge == "auto" and splits <= MERGE_LAST_MAX_SPLITS))


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def plan(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sms: int = DEFAULT_SM_COUNT,
) -> dict:
    """Launch shape from tensor shapes only. Decode-only steps (one token per sequence) get
    single-token tiles and a context split large enough to fill the GPU."""
    group = num_heads // num_kv_heads
    decode = num_tokens == num_seqs  # every scheduled sequence has >= 1 new token
    tile_q = 1 if decode else max(1, 64 // group)
    tile_m = max(16, _pow2(tile_q * group))
    tiles = num_seqs if decode else num_tokens // tile_q + num_seqs
    splits = 1
    if decode:
        # Until the programs fill the SMs four times over: more splits mean more partial results
        # to combine and shorter loops (docs/gpu-kernels.md, "PagedAttention").
        while tiles * num_kv_heads * splits < 4 * sms and splits < 16:
            splits *= 2
    # Warps: the decode launch keeps the 2 it was timed with; a prefill / mixed tile (64 query
    # rows and more) takes 4: with 2 it spilled on sm_90 and was the slowest timed, and 8 were
    # slower than 4 (docs/gpu-kernels.md, "PagedAttention", 2026-12-06).
    warps = 2 if decode else 4
    return {
        # A mixed step's one-token sequences in a decode-shaped launch of their own, at head
        # dim 128 and more: in the query tiles each fills one 64-row tile with GROUP rows and
        # reads its whole context in one program, which at head dim 128 took 1.4-1.7x the two
        # launches' time; at head dim 64 those tiles are cheap and run beside the chunk's, and
        # one launch was as fast or faster on 3 of the 4 steps timed (same section).
        "singles": not decode and _pow2(head_dim) >= 128,
        "tile_q": tile_q,
        "tile_m": tile_m,
        "tiles": tiles,
        "splits": splits,
        "decode": decode,
        "num_warps": warps,
        # A one-token query's split reads its first K/V tile before waiting for the q/k/v
        # projection (`_paged_attention`), where its programs fit the SMs at once: beyond that
        # its larger programs were no faster (docs/gpu-kernels.md, "Decode: the K/V of earlier
        # steps read before the wait"). A query tile's many rows make its wait the smaller
        # part. Not at head dim 128: at 2 warps the tile held across the wait takes all 255
        # registers a thread on sm_90.
        "prefetch": decode and _pow2(head_dim) <= 64 and tiles * num_kv_heads * splits <= sms,
    }


def paged_attention(
    query,
    key,
    value,
    kv_cache,
    slot_mapping,
    block_tables,
    context_lens,
    query_start_loc,
    *,
    tile_k: int = 64,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
    heads_first: bool = True,
    write_kv: bool = True,
    merge: str = "auto",
    singles: bool | None = None,
    prefetch: bool | None = None,
    **attrs,
):
    """Same contract as the reference: returns ``(out [T, H*D], kv_cache)``, cache written in place;
    ``attrs`` the op's attributes, as `trtc.plugins.paged_attention.paged_attention` takes them.
    An FP8 cache is read as E4M3 values converted to the query dtype (exact: every E4M3 value is
    an fp16/bf16 value); ``k_scale`` folds into the softmax scale and ``v_scale`` into the output.
    The other keywords choose the launch (`plan` by default); ``num_splits`` is the context
    split of the launch that has one (a decode step's, or a mixed step's one-token sequences'
    with ``singles``), ``num_warps`` the warps of the query tiles' launch, ``prefetch`` whether
    that launch reads a K/V tile before its PDL wait."""
    a = SPEC.attribute_values(attrs)
    num_heads, num_kv_heads, head_dim = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    k_scale, v_scale = a["k_scale"], a["v_scale"]
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    check_scales(kv_cache.dtype, k_scale, v_scale)
    # write_kv=False: the new K/V are already in their slots (the CUDA executor's fused rotary +
    # cache-write kernel put them there).
    num_tokens = query.shape[0]
    num_seqs = context_lens.shape[0]
    row = num_kv_heads * head_dim
    if write_kv:
        _write_kv[(num_tokens,)](
            key.contiguous(),
            value.contiguous(),
            kv_cache,
            slot_mapping,
            kv_cache.stride(0),
            k_scale,
            v_scale,
            ROW=row,
            ROW_P2=_pow2(row),
            FP8=fp8,
            **pdl.launch_options(query.device),
        )
    if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
        raise ValueError(f"paged_attention: num_splits must be a power of two, got {num_splits}")
    sms = sm_count(query.device)
    p = _with_prefetch(plan(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, sms), prefetch)
    if singles is None:
        singles = p["singles"]
    out = torch.empty_like(query)
    step = _Step(
        query.contiguous(),
        kv_cache,
        out,
        block_tables,
        context_lens,
        query_start_loc,
        a,
        tile_k,
        num_stages,
        heads_first,
    )
    if p["decode"] or not singles:
        _attend(step, p, 0, num_splits or p["splits"], merge, num_warps or p["num_warps"])
    else:
        # A mixed step: its one-token sequences (the decode rows beside a prompt chunk) through
        # a decode step's launch (single-token tiles, the context split), merged by the last
        # split (a `_combine` launch would rewrite every token's rows); the rest through the
        # query tiles, whose programs skip the one-token sequences.
        one = plan(num_seqs, num_seqs, num_heads, num_kv_heads, head_dim, sms)
        one = _with_prefetch(one, prefetch)
        _attend(step, one, 1, num_splits or one["splits"], "last", one["num_warps"])
        _attend(step, p, 2, 1, merge, num_warps or p["num_warps"])
    return out, kv_cache


def _with_prefetch(p: dict, prefetch: bool | None) -> dict:
    """The plan with the caller's choice of the early K/V read (a decode-shaped launch's only)."""
    return p if prefetch is None or not p["decode"] else dict(p, prefetch=prefetch)


class _Step(NamedTuple):
    """What every launch of one `paged_attention` call shares: its tensors, the op's attribute
    values (`SPEC.attribute_values`) and the launch options the caller chose."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    out: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    attrs: dict
    tile_k: int
    num_stages: int
    heads_first: bool


def _attend(step: _Step, p: dict, seqs: int, splits: int, merge: str, num_warps: int) -> None:
    """One `_paged_attention` launch of plan ``p`` over the sequences ``seqs`` selects (0: all,
    1: the one-token ones of a mixed step, 2: the others), writing its rows of ``step.out``; with
    ``splits`` > 1 the partial results are merged by the last split or by `_combine` (``merge``:
    "last", "kernel" or "auto", as `paged_attention` takes it)."""
    query, kv_cache, out, a = step.query, step.kv_cache, step.out, step.attrs
    num_heads, num_kv_heads, head_dim = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    num_tokens = query.shape[0]
    d_p2 = _pow2(head_dim)
    if splits > 1:
        part_acc = torch.empty(
            num_tokens * num_heads * splits, d_p2, dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(
            num_tokens * num_heads * splits, 2, dtype=torch.float32, device=query.device
        )
    else:
        part_acc = part_ml = out  # unused
    merge_last = merges_last(splits, merge)
    counters = arrival_counters(query.device, p["tiles"] * num_kv_heads) if merge_last else out
    tiles = p["tiles"]
    grid = (num_kv_heads, tiles, splits) if step.heads_first else (tiles, num_kv_heads, splits)
    launch = pdl.launch_options(query.device)
    _paged_attention[grid](
        query,
        kv_cache,
        out,
        part_acc,
        part_ml,
        counters,
        step.block_tables,
        step.context_lens,
        step.query_start_loc,
        step.context_lens.shape[0],
        step.block_tables.shape[1],
        kv_cache.stride(0),
        a["scale"] * a["k_scale"],
        a["v_scale"],
        a["sliding_window"],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=d_p2,
        BLOCK_SIZE=kv_cache.shape[2],
        TILE_Q=p["tile_q"],
        TILE_M=p["tile_m"],
        TILE_K=step.tile_k,
        NUM_SPLITS=splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DECODE=p["decode"],
        SEQS=seqs,
        HEADS_FIRST=step.heads_first,
        MERGE_LAST=merge_last,
        PREFETCH=p["prefetch"],
        MERGE_CHUNK=merge_chunk(p["tile_m"], d_p2),
        num_warps=num_warps,
        num_stages=step.num_stages,
        **launch,
    )
    if splits > 1 and not merge_last:
        _combine[(num_tokens * num_heads,)](
            part_acc, part_ml, out, HEAD_DIM=head_dim, HEAD_DIM_P2=d_p2, NUM_SPLITS=splits, **launch
        )
