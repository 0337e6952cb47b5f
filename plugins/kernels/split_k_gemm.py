"""A split-K GEMM for the dense (fp16/bf16) projections of decode steps of 16 to 64 rows: ``y = x
@ W.T`` (ONNX Gemm with transB = 1, F.linear's semantics: fp32 accumulation, the result rounded
once to x's dtype). Not yet on the executor's path: it is there to be timed against cuBLAS
(`benchmarks/gemm_shapes.py`, variant ``splitk``) before a projection is given to it.

At 64 rows a projection is still a stream of its weight bytes (the 8B model's o projection: 33.5
MB read, 0.5 GFLOP), and it is fast only if every SM streams: cuBLAS read that weight at 47% of
copy bandwidth on an H100 (BENCHMARKS.md, 2026-12-06, 16:40 UTC), qkv at 74%, down at 80%. Here
the output columns are cut into ``BLOCK_N`` tiles and K into ``splits`` chunks, one program a
(tile, chunk), enough programs to fill the GPU a few times over; each multiplies its rows on the
tensor cores and stores an fp32 partial, and the last program of a tile to arrive (an arrival
counter, `trtc.plugins.kernels.arrival_counters`) adds the partials in split order and writes the
tile: one launch, deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtc.plugins.kernels import pdl
from trtc.plugins.kernels.arrival_counters import arrival_counters

MAX_ROWS = 64  # one BLOCK_M tile of rows; more rows go to cuBLAS, compute-bound by then


@triton.jit
def _split_k_gemm(
    x_ptr,
    w_ptr,
    part_ptr,
    y_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_x,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (tile, split): rows 0..M-1 of output columns ``tile * BLOCK_N ..`` over K positions
    ``split * CHUNK ..`` (CHUNK a multiple of BLOCK_K)."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    pdl.begin(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_begin = split * CHUNK
    for k0 in range(k_begin, k_begin + CHUNK, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",  # read once a step; keep L2 for x and the partials
        )
        acc += tl.dot(x, tl.trans(w))
    out = y_ptr + rows[:, None] * N + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLITS == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # partials: [SPLITS, BLOCK_M, N] fp32
        part = part_ptr + (split * BLOCK_M + rows[:, None]) * N + cols[None, :]
        tl.store(part, acc, mask=mask)
        tl.debug_barrier()  # every thread's stores precede the arrival
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(SPLITS):  # split order: the same sum on every launch
                total += tl.load(
                    part_ptr + (s * BLOCK_M + rows[:, None]) * N + cols[None, :],
                    mask=mask,
                    other=0.0,
                    cache_modifier=".cg",  # L2, not a stale L1 line
                )
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `split_k_gemm` takes ``x [M, K] @ weight[N, K].T``: CUDA (or Triton's
    interpreter), fp16/bf16, 1 to `MAX_ROWS` rows with unit column stride, weight contiguous."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and x.shape[1] == weight.shape[1]
    )


def plan(
    rows: int, n: int, k: int, sms: int = 132, block_n: int | None = None, splits: int | None = None
) -> dict:
    """Tiles and split for ``rows x k @ k x n``: 128-column tiles (64 when 128-column tiles
    would not outnumber the SMs), K cut in chunks of whole 64-wide steps until the programs fill
    the SMs about three times over. ``block_n`` and ``splits`` override the choice (the
    benchmark's variants); the split is then cut so that no chunk is empty."""
    block_m = max(16, triton.next_power_of_2(rows))
    block_n = block_n or (64 if triton.cdiv(n, 128) < sms else 128)
    block_k = 64
    tiles = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    if splits is None:
        splits = 1
        while tiles * splits < 3 * sms and splits * 2 <= steps and splits < 16:
            splits *= 2
    chunk = triton.cdiv(steps, splits) * block_k
    return {
        "block_m": block_m,
        "block_n": block_n,
        "block_k": block_k,
        "chunk": chunk,
        "splits": triton.cdiv(k, chunk),  # no empty chunk
        "tiles": tiles,
        # a 64 x 128 fp32 accumulator spills at 4 warps on sm_90 (ptxas -v: 1 KB a thread)
        "num_warps": 8 if block_m * block_n > 4096 else 4,
        "num_stages": 4,
    }


def split_k_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    block_n: int | None = None,
    splits: int | None = None,
    use_pdl: bool | None = None,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T`` in x's dtype (`supports` must hold). ``block_n`` and
    ``splits`` override `plan`'s choice, ``use_pdl`` the module default."""
    m, k = x.shape
    n = weight.shape[0]
    p = plan(m, n, k, block_n=block_n, splits=splits)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if p["splits"] > 1:
        part = torch.empty(p["splits"], p["block_m"], n, dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, p["tiles"])
    else:
        part = counters = y  # unused
    _split_k_gemm[(p["tiles"], p["splits"])](
        x,
        weight,
        part,
        y,
        counters,
        m,
        n,
        k,
        x.stride(0),
        BLOCK_M=p["block_m"],
        BLOCK_N=p["block_n"],
        BLOCK_K=p["block_k"],
        CHUNK=p["chunk"],
        SPLITS=p["splits"],
        num_warps=p["num_warps"],
        num_stages=p["num_stages"],
        **pdl.launch_options(x.device, use_pdl),
    )
    return y
