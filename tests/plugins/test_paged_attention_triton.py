"""The Triton PagedAttention kernels against the reference. Without a GPU they run in Triton's
CPU interpreter (TRITON_INTERPRET=1, set in conftest) at small sizes; on a GPU (marker `gpu`)
at real sizes and in fp16/bf16."""

from __future__ import annotations

import os

import pytest
import torch

from harness.attention_cases import make_case
from harness.sm90_compile import run_probe
from trtc.plugins.kernels import arrival_counters
from trtc.plugins.paged_attention.reference import paged_attention as reference_attention
from trtc.plugins.paged_attention.reference import to_cache

triton_kernels = pytest.importorskip(
    "trtc.plugins.paged_attention.triton_kernels", reason="triton is not installed"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def check(
    seqs,
    heads,
    kv_heads,
    D,
    block_size,
    window=0,
    dtype=torch.float32,
    splits=None,
    seed=0,
    num_blocks=64,
    atol=2e-5,
    kv_scales=None,
    padding=1,
    before=None,
    **options,
):
    """``kv_scales=(k_scale, v_scale)``: the cache is FP8 (context stored through the reference's
    `to_cache`), and the reference reads the very same FP8 cache. ``before``: called just
    before the kernels are launched (a kernel to launch ahead of them)."""
    ref = make_case(
        seqs, heads, kv_heads, D, block_size, num_blocks, seed, dtype=torch.float32, padding=padding
    )
    kern = make_case(
        seqs,
        heads,
        kv_heads,
        D,
        block_size,
        num_blocks,
        seed,
        dtype=dtype,
        device=DEVICE,
        padding=padding,
    )
    kw = dict(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=D, scale=D**-0.5, sliding_window=window
    )
    if kv_scales:
        # The reference caches exactly the new K/V the kernel gets (rounded to ``dtype``): the
        # cache bytes are compared bit for bit below.
        ref.query, ref.key, ref.value = (
            t.float().cpu() for t in (kern.query, kern.key, kern.value)
        )
        kw.update(k_scale=kv_scales[0], v_scale=kv_scales[1])
        fp8 = torch.empty(ref.kv_cache.shape, dtype=torch.float8_e4m3fn)
        for i, s in enumerate(kv_scales):
            fp8[i] = to_cache(ref.kv_cache[i], fp8.dtype, s)
        ref.kv_cache, kern.kv_cache = fp8, fp8.clone().to(DEVICE)
    want, want_cache = reference_attention(*ref.args(), **kw)
    if before is not None:
        before()
    got, got_cache = triton_kernels.paged_attention(
        *kern.args(), num_splits=splits, **options, **kw
    )
    n_real = int(ref.query_start_loc[-1])
    if kv_scales:  # bit for bit, on the GPU and in the interpreter alike
        same = got_cache.cpu().view(torch.uint8) == want_cache.view(torch.uint8)
        assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} cache bytes differ"
    err = (got[:n_real].float().cpu() - want[:n_real]).norm() / want[:n_real].norm()
    assert not torch.isnan(got[:n_real]).any()
    assert err < atol, f"relative error {err:.2e}"
    if not kv_scales:
        torch.testing.assert_close(
            got_cache.float().cpu(), want_cache.to(dtype).float(), atol=0, rtol=0
        )


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("singles", [True, False])
def test_mixed_prefill_and_decode(heads, kv_heads, block_size, singles):
    # singles: the one-token sequences through a decode-shaped launch of their own (the default),
    # the others through the query tiles; else every sequence through the query tiles.
    seqs = [(9, 1), (0, 7), (block_size * 2 - 1, 5), (block_size, block_size + 1), (3, 1)]
    check(seqs, heads, kv_heads, 16, block_size, seed=heads + block_size, singles=singles)
    assert arrival_counters.all_zero()


@pytest.mark.parametrize("splits", [1, 2, 4, 16])
@pytest.mark.parametrize("merge", ["last", "kernel"])
def test_decode_split_k(splits, merge):
    # merge="last": the last split to finish merges the partial results (one launch); "kernel":
    # a second kernel does. Either way the arrival counters are left at zero for the next launch.
    seqs = [(70, 1), (5, 1), (33, 1), (0, 1)]
    check(seqs, 8, 2, 16, 16, splits=splits, seed=splits, num_blocks=32, merge=merge)
    check(
        [(70, 1), (5, 1)],
        8,
        2,
        16,
        16,
        splits=splits,
        seed=7,
        num_blocks=32,
        merge=merge,
        padding=0,
    )
    # 16-position tiles, one sequence (a decode step: the early read): a split reads several
    # (the first before the PDL wait, the rest in the loop), and 16 splits leave 5 with
    # positions, so the merge takes a second chunk of splits.
    assert triton_kernels.plan(1, 1, 8, 2, 16)["prefetch"]
    check(
        [(70, 1)],
        8,
        2,
        16,
        16,
        splits=splits,
        seed=11,
        num_blocks=32,
        merge=merge,
        tile_k=16,
        padding=0,
    )
    # The early K/V read at every split and merge, whatever `plan` gives for the batch: four
    # sequences, one with no position before its new one.
    check(
        seqs,
        8,
        2,
        16,
        16,
        splits=splits,
        seed=12,
        num_blocks=32,
        merge=merge,
        padding=0,
        prefetch=True,
    )
    assert arrival_counters.all_zero()


@pytest.mark.parametrize("prefetch", [None, True])
@pytest.mark.parametrize("splits,heads_first", [(1, False), (2, True), (4, False)])
def test_decode_only_step(splits, heads_first, prefetch):
    # T == S (no padding row): the kernel's decode path, one program column per sequence; at
    # five sequences `plan` leaves the early K/V read off, and prefetch=True forces it.
    seqs = [(70, 1), (5, 1), (33, 1), (0, 1), (16, 1)]
    assert triton_kernels.plan(5, 5, 8, 2, 16)["decode"]
    assert not triton_kernels.plan(5, 5, 8, 2, 16)["prefetch"]
    check(
        seqs,
        8,
        2,
        16,
        16,
        splits=splits,
        seed=3 + splits,
        num_blocks=32,
        padding=0,
        heads_first=heads_first,
        prefetch=prefetch,
    )
    check(
        seqs,
        8,
        2,
        16,
        16,
        splits=splits,
        seed=4,
        num_blocks=32,
        padding=0,
        window=20,
        heads_first=heads_first,
        prefetch=prefetch,
    )


def test_plan_splits_a_mixed_steps_one_token_sequences_off_at_head_dim_128():
    """The launch forms timed on the H100 (docs/gpu-kernels.md, "Mixed steps: the one-token
    sequences in a launch of their own"): two launches at head dim 128, one at 64; query tiles
    at 4 warps; a decode step is one launch of its own kind."""
    mixed_128 = triton_kernels.plan(300, 3, 32, 8, 128)
    assert mixed_128["singles"] and mixed_128["num_warps"] == 4
    mixed_64 = triton_kernels.plan(300, 3, 32, 4, 64)
    assert not mixed_64["singles"] and mixed_64["num_warps"] == 4
    decode = triton_kernels.plan(64, 64, 32, 8, 128)
    assert decode["decode"] and not decode["singles"] and decode["num_warps"] == 2


def test_plan_reads_early_where_the_decode_launch_fits_the_sms():
    """The early K/V read (docs/gpu-kernels.md, "Decode: the K/V of earlier steps read before the
    wait"): on where a decode launch has at most one program an SM (1.1B geometry: 1-2
    sequences, 16 splits), off at 4 and more (at 8 and 64 timed no faster), at head dim
    128, and on a GPU of fewer SMs at the same batch."""
    assert [triton_kernels.plan(b, b, 32, 4, 64)["prefetch"] for b in (1, 2, 4, 8, 64)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert not triton_kernels.plan(1, 1, 32, 8, 128)["prefetch"]
    assert not triton_kernels.plan(2, 2, 32, 4, 64, sms=114)["prefetch"]
    assert not triton_kernels.plan(300, 3, 32, 4, 64)["prefetch"]  # query tiles


@pytest.mark.parametrize("singles", [True, False])
def test_sliding_window(singles):
    check([(40, 1), (10, 12), (0, 30)], 4, 2, 16, 8, window=9, seed=5, singles=singles)


@pytest.mark.parametrize("splits", [1, 2])
def test_fp8_kv_cache(splits):
    seqs = [(20, 1), (0, 9), (13, 4), (40, 1)]
    check(seqs, 8, 2, 16, 8, splits=splits, seed=21, kv_scales=(0.02, 0.015))
    # The one-token sequences through the decode-shaped launch (its first tile read before the
    # wait, the token's own K/V after), in a mixed step and in a decode step.
    check(seqs, 8, 2, 16, 8, splits=splits, seed=22, kv_scales=(0.02, 0.015), singles=True)
    decode = [(20, 1), (5, 1), (40, 1)]
    check(decode, 8, 2, 16, 8, splits=splits, seed=23, kv_scales=(0.02, 0.015), padding=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_fp8_kv_cache(dtype):
    seqs = [(2047, 1)] * 8 + [(0, 300), (500, 129), (17, 1)]
    check(
        seqs,
        32,
        4,
        64,
        16,
        dtype=dtype,
        seed=12,
        num_blocks=2048,
        atol=1e-2,
        kv_scales=(0.02, 0.015),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim", [(4, 64), (8, 128)])  # one launch / two (`plan`)
def test_gpu_real_sizes(dtype, kv_heads, head_dim):
    seqs = [(2047, 1)] * 8 + [(0, 300), (500, 129), (17, 1)]
    check(seqs, 32, kv_heads, head_dim, 16, dtype=dtype, seed=11, num_blocks=2048, atol=1e-2)
    assert arrival_counters.all_zero()


def hold_back_the_stream():
    """Launches, with PDL, a kernel that spins for about half a millisecond: the kernels
    launched after it start long before it ends, and only their waits keep them in order."""
    import triton
    import triton.language as tl

    from trtc.plugins.kernels import pdl

    @triton.jit
    def spin(out_ptr, n, PDL: tl.constexpr):
        pdl.begin(PDL)
        acc = tl.load(out_ptr)
        for _ in range(n):  # dependent fmas
            acc = acc * 0.999 + 1.0
        tl.store(out_ptr, acc)

    flag = torch.zeros(1, device="cuda")
    assert pdl.enabled(flag.device), "the GPU runs this test only where it has PDL"
    spin[(1,)](flag, 200_000, **pdl.launch_options(flag.device))


def check_behind_a_spinning_kernel(seqs, kv_heads, head_dim, seed, **options):
    """`check` at 32 query heads in fp16, the kernels launched behind `hold_back_the_stream`."""
    check(
        seqs,
        32,
        kv_heads,
        head_dim,
        16,
        dtype=torch.float16,
        seed=seed,
        num_blocks=128,
        atol=1e-2,
        padding=0,
        before=hold_back_the_stream,
        **options,
    )


@pytest.mark.gpu
def test_gpu_decode_reads_the_new_token_after_its_wait():
    """A decode launch reads the K/V of earlier steps before its PDL wait and the token's own
    after it. Here the kernel ahead of it (`_write_kv`, which writes the new tokens' K/V, as the
    q/k/v projection's epilogue does in a step) is itself held back by a spinning kernel, so the
    attention's programs start long before the new K/V are in the cache: an early read of the
    token's own slot sees zeros and the output is wrong."""
    # New positions at the start, the middle and the end of a 64-position tile, and alone.
    seqs = [(0, 1), (37, 1), (63, 1), (64, 1), (200, 1)]
    for splits in (None, 1):
        check_behind_a_spinning_kernel(seqs, 4, 64, 31, splits=splits, prefetch=True)


@pytest.mark.gpu
def test_gpu_a_launch_with_nothing_to_do_still_waits():
    """A mixed step at head dim 128 with no one-token sequence: the launch for those (SEQS == 1)
    has nothing to do, and every program of it returns at once. It must still wait for the
    kernel ahead of it (`_write_kv`, held back by a spinning kernel), or it completes first and
    the query tiles' launch after it, which waits only for it, reads the cache before the new
    K/V are written (`trtc.plugins.kernels.pdl`: every program waits before it exits)."""
    assert triton_kernels.plan(57, 2, 32, 8, 128)["singles"]
    check_behind_a_spinning_kernel([(0, 40), (50, 17)], 8, 128, 32)


def test_fp8_rounding_is_torchs_bit_for_bit():
    """`round_to_e4m3` + cast against torch's fp32 -> E4M3 cast on every E4M3 value, the midpoints
    between neighbours (ties: half to even), just either side of them, subnormals, signed zeros
    and values past the saturation bound."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(y_ptr + offs, triton_kernels.round_to_e4m3(x).to(tl.float8e4nv), mask=mask)

    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids.nextafter(torch.tensor(-1e9)), mids.nextafter(torch.tensor(1e9))])
    extra = torch.tensor(
        [0.0, -0.0, 1e-12, -1e-12, 447.9, 460.0, 464.0, 500.0, -1e6, 2**-10, 2**-9.5]
    )
    x = torch.cat([grid, mids, near, extra, torch.randn(4096) * 50]).contiguous()
    want = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    got = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    cast[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), got, x.numel(), BLOCK=1024)
    diff = got.cpu().view(torch.uint8) != want.view(torch.uint8)
    assert not diff.any(), f"{int(diff.sum())} differ, e.g. {x[diff][:5].tolist()}"


@pytest.mark.gpu
def test_gpu_decode_merge_in_a_cuda_graph():
    """The default decode plan (splits merged by the last program) replayed in a CUDA graph: the
    same output as a merge kernel on every replay (the arrival counters reset themselves)."""
    seqs = [(1500 + 7 * i, 1) for i in range(32)]
    case = make_case(
        seqs, 32, 4, 64, 16, 4096, seed=17, dtype=torch.float16, device="cuda", padding=0
    )
    kw = dict(num_heads=32, num_kv_heads=4, head_dim=64, scale=0.125)
    want, _ = triton_kernels.paged_attention(*case.args(), merge="kernel", write_kv=False, **kw)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        triton_kernels.paged_attention(*case.args(), write_kv=False, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got, _ = triton_kernels.paged_attention(*case.args(), write_kv=False, **kw)
    for _ in range(3):
        got.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    assert arrival_counters.all_zero()


SPILL_PROBE = r"""
from trtc.plugins.paged_attention import triton_kernels as tk

sig = {"q_ptr": "*fp16", "cache_ptr": "*fp16", "out_ptr": "*fp16", "part_acc_ptr": "*fp32",
       "part_ml_ptr": "*fp32", "counter_ptr": "*i32", "block_tables_ptr": "*i32",
       "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "num_seqs": "i32",
       "max_blocks": "i32", "cache_kv_stride": "i64", "scale": "fp32", "v_scale": "fp32",
       "sliding_window": "i32"}


def launch(p, seqs, merge_last, heads, kv_heads, head_dim):
    consts = dict(NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, GROUP=heads // kv_heads,
                  HEAD_DIM=head_dim, HEAD_DIM_P2=tk._pow2(head_dim), BLOCK_SIZE=16,
                  TILE_Q=p["tile_q"], TILE_M=p["tile_m"], TILE_K=64, NUM_SPLITS=p["splits"],
                  DOT_PRECISION="tf32", DECODE=p["decode"], SEQS=seqs, HEADS_FIRST=True,
                  MERGE_LAST=merge_last, PREFETCH=p["prefetch"],
                  MERGE_CHUNK=tk.merge_chunk(p["tile_m"], tk._pow2(head_dim)), PDL=True)
    # (the cache's K-to-V stride, blocks x 16 slots x KV heads x head dim, is a multiple of 16)
    asm = compile_sm90(tk._paged_attention, sig, consts, aligned=("cache_kv_stride",),
                       num_warps=p["num_warps"], num_stages=3)
    registers, stores, loads = ptxas_report(asm["ptx"])
    kind = "singles" if seqs == 1 else "decode" if p["decode"] else "tiles"
    print(heads, kv_heads, head_dim, kind, p["splits"], merge_last, p["num_warps"],
          p["prefetch"], registers, f"{stores}/{loads}")


# (heads, KV heads, head dim): the 1.1B and 8B geometries, multi-query, and SmolLM2's. Each
# launch form `paged_attention` makes: a prefill / mixed step's query tiles (and at head dim
# 128 its one-token sequences' launch, merged by the last split), a decode step of one sequence
# and of 64 (merged as `merges_last` says for the default merge).
for heads, kv_heads, head_dim in [(32, 4, 64), (32, 8, 128), (32, 1, 128), (9, 3, 64)]:
    mixed = tk.plan(300, 3, heads, kv_heads, head_dim)
    launch(mixed, 2 if mixed["singles"] else 0, False, heads, kv_heads, head_dim)
    if mixed["singles"]:
        one = tk.plan(3, 3, heads, kv_heads, head_dim)
        launch(one, 1, tk.merges_last(one["splits"], "last"), heads, kv_heads, head_dim)
    for seqs in (1, 64):
        p = tk.plan(seqs, seqs, heads, kv_heads, head_dim)
        launch(p, 0, tk.merges_last(p["splits"], "auto"), heads, kv_heads, head_dim)
"""


def test_attention_launches_compile_without_spills():
    """Each launch form `paged_attention` makes, compiled for sm_90 as Triton's launcher
    compiles it (16-byte aligned pointers, the cache stride a multiple of 16; ptxas -v), spills
    nothing: a prefill / mixed step's 64-row query tiles at 4 warps, its one-token sequences'
    launch at head dim 128, and the decode launch at 2 warps, merged by `_combine` or by its
    last split, with its early read of a K/V tile where `plan` gives it (docs/gpu-kernels.md,
    "PagedAttention"). The query tiles at 2 warps spilled and were the slowest timed."""
    lines = run_probe(SPILL_PROBE)
    assert len(lines) == 14, lines
    forms = {(line.split()[3], line.split()[5]) for line in lines}  # (kind, merged by the last)
    assert forms == {
        ("tiles", "False"),
        ("singles", "True"),
        ("decode", "False"),
        ("decode", "True"),
    }, lines
    for line in lines:
        _, _, head_dim, kind, splits, _, warps, prefetch, _, spills = line.split()
        assert warps == ("4" if kind == "tiles" else "2"), line
        if kind == "decode" and splits == "16" and int(head_dim) <= 64:
            assert prefetch == "True", line  # one sequence: the early read
        assert spills == "0/0", line  # spill stores / loads, bytes a thread
