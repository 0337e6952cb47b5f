"""The Triton Int4Gemm kernels against the reference. Without a GPU they run in Triton's CPU
interpreter (TRITON_INTERPRET=1, set in conftest) at small sizes; on a GPU (marker `gpu`) at
the Llama-7B projection sizes, in fp16 and bf16."""

from __future__ import annotations

import pytest
import torch

from harness.int4_layers import DEVICE, make_layer
from trtc.plugins.int4_gemm.reference import dequantize
from trtc.plugins.int4_gemm.reference import int4_gemm as reference
from trtc.plugins.kernels import arrival_counters

triton_kernels = pytest.importorskip(
    "trtc.plugins.int4_gemm.triton_kernels", reason="triton is not installed"
)
Plan = triton_kernels.Plan
# ||out - ref|| / ||ref|| against fp64: fp32 arithmetic, and fp16/bf16 outputs (one rounding).
REL_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def check(tokens, n, k, group, dtype=torch.float16, bias=True, plan=None, seed=0):
    qweight, scales, zeros, b = make_layer(n, k, group, dtype, bias, seed)
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    x = torch.randn(tokens, k, generator=g, device=DEVICE).to(dtype)
    kw = dict(group_size=group, in_features=k, out_features=n)
    chosen = plan or triton_kernels.default_plan(tokens, n, k, group, fp16=dtype == torch.float16)
    out = torch.full((tokens, n), float("nan"), dtype=dtype, device=DEVICE)
    workspace = torch.full((chosen.split_k * tokens * n,), float("nan"), device=DEVICE)
    got = triton_kernels.int4_gemm(
        x, qweight, scales, zeros, b, plan=chosen, out=out, workspace=workspace, **kw
    )
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any(), "some outputs were not written (or a split was lost)"
    w = dequantize(qweight, scales, zeros, group).double()
    exact = x.double() @ w.T + (b.double() if bias else 0)
    err = float((got.double() - exact).norm() / exact.norm())
    assert err < REL_TOL[dtype], f"relative error {err:.2e} ({chosen})"
    if dtype == torch.float32:
        # fp32 activations keep the fp32 weight: element by element against the reference, up
        # to the order of fp32 additions. (fp16/bf16 round each weight (q - z) * s to x's dtype
        # first, the operand the matrix units take.)
        torch.testing.assert_close(got, reference(x, qweight, scales, zeros, b, **kw))
    return err


# K = 2 groups + 24 columns: every group size has a shorter last group; N is no multiple of 16.
@pytest.mark.parametrize("tokens", [1, 3, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_default_plan_matches_reference(tokens, dtype):
    group = {1: 32, 3: 64, 16: 128, 40: 64}[tokens]
    check(tokens, 40, 2 * group + 24, group, dtype, bias=tokens % 2 == 1, seed=tokens)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_group_sizes_with_a_short_last_group(group, bias):
    check(2, 24, 3 * group - 8, group, torch.float16, bias=bias, seed=group)
    check(5, 24, 3 * group - 8, group, torch.bfloat16, bias=bias, seed=group + 1)
    check(
        3,
        24,
        3 * group - 8,
        group,
        torch.bfloat16,
        bias=bias,
        seed=group + 2,
        plan=Plan(16, 16, split_k=2, reduce="last", block_k=128),
    )


@pytest.mark.parametrize(
    "plan",
    [
        Plan(16, 16),
        Plan(16, 32, split_k=3, block_k=128),  # 3 steps of 128 columns (2 groups each)
        Plan(16, 16, split_k=4, reduce="last", block_k=128),  # one split is empty
        Plan(16, 16, split_k=2, reduce="last"),  # uneven splits: 1 step + a masked one
        Plan(16, 32, block_k=512),  # one step, 8 groups, most of it masked
        Plan(16, 16, split_k=8, reduce="last", block_k=128, max_registers=128),  # 5 empty splits
    ],
    ids=lambda p: f"t{p.block_t}-n{p.block_n}-k{p.block_k}-s{p.split_k}-{p.reduce}",
)
def test_every_plan_variant(plan):
    check(3, 40, 4 * 64 + 40, 64, torch.float16, bias=True, plan=plan, seed=7)
    # reduce="last" leaves its arrival counters zero for the next call.
    assert arrival_counters.all_zero()


# The weights-first decode kernel (`_int4_rows`): N no multiple of the rows per program, K with
# a shorter last group; the whole row in up to three pieces (loaded before the wait), 6 steps
# (unrolled) and 11 steps (a loop).
ROWS_PLANS = {
    "whole-n4": Plan(16, 4, kernel="rows", num_stages=1, block_k=4096),
    "whole-n8-w8": Plan(16, 8, kernel="rows", num_warps=8, num_stages=1, block_k=4096),
    "steps-n8-2groups": Plan(16, 8, kernel="rows", num_stages=1, block_k=64),
    "steps-n4-1group": Plan(16, 4, kernel="rows", num_warps=2, num_stages=1, block_k=32),
}


@pytest.mark.parametrize("name", list(ROWS_PLANS))
@pytest.mark.parametrize("tokens", [1, 2, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rows_kernel_matches_reference(name, tokens, dtype):
    plan = ROWS_PLANS[name]
    # 11 groups of 32, the last one 24 columns: pieces of 8 + 2 + 1 groups.
    check(tokens, 37, 10 * 32 + 24, 32, dtype, bias=tokens % 2 == 1, plan=plan, seed=tokens)
    # 3 groups of 128, the last one 64 columns: pieces of 2 + 1.
    check(tokens, 20, 2 * 128 + 64, 128, dtype, bias=tokens % 2 == 0, plan=plan, seed=tokens + 1)


def test_row_pieces():
    assert triton_kernels.row_pieces(86) == (64, 16, 8)  # K = 11008, group 128
    assert triton_kernels.row_pieces(32) == (32, 0, 0)
    assert triton_kernels.row_pieces(11) == (8, 2, 1)
    assert triton_kernels.row_pieces(7) == (4, 2, 1)
    assert triton_kernels.row_pieces(1) == (1, 0, 0)
    for groups in range(1, 300):
        a, b, c = triton_kernels.row_pieces(groups)
        assert a + b <= groups <= a + b + c and (c == 0 or groups - a - b > c // 2)


def test_rows_kernel_with_leading_dims_and_steps_past_the_row():
    # 3 steps of 2 groups for a row of 5 groups: the last step is half padding (reads nothing).
    plan = Plan(16, 2, kernel="rows", num_stages=1, block_k=128)
    check(3, 5, 5 * 64, 64, torch.float16, bias=True, plan=plan, seed=11)
    qweight, scales, zeros, b = make_layer(6, 128, 64, torch.float16, False, 12)
    x = torch.randn(2, 1, 128).half().to(DEVICE)
    kw = dict(group_size=64, in_features=128, out_features=6)
    got = triton_kernels.int4_gemm(x, qweight, scales, zeros, plan=plan, **kw)
    want = reference(x.float(), qweight, scales.float(), zeros, None, **kw)
    assert got.shape == (2, 1, 6)
    assert float((got.float() - want).norm() / want.norm()) < 1e-3


def test_decode_steps_of_one_or_two_tokens_go_to_the_rows_kernel_where_it_won():
    plan = triton_kernels.default_plan
    assert plan(1, 4096, 4096, 128) == Plan(
        16, 8, kernel="rows", num_stages=1, block_k=4096, half2=True, evict_first=True
    )
    assert plan(1, 4096, 11008, 128) == Plan(
        16, 8, kernel="rows", num_warps=8, num_stages=1, block_k=16384, half2=True, evict_first=True
    )
    assert plan(1, 11008, 4096, 128).kernel == "rows"
    assert not plan(1, 4096, 4096, 128, fp16=False).half2  # bf16: fp32 products
    # Two tokens: half2 products on rows of at most 4096 columns; bf16 on the small layer only.
    assert plan(2, 4096, 4096, 128) == Plan(
        16, 4, kernel="rows", num_stages=1, block_k=4096, half2=True, evict_first=True
    )
    assert plan(2, 11008, 4096, 128).half2
    assert plan(2, 4096, 4096, 128, fp16=False) == Plan(
        16, 4, kernel="rows", num_stages=1, block_k=2048, evict_first=True
    )
    for t, n, k, fp16 in (
        (2, 11008, 4096, False),
        (2, 4096, 11008, True),
        (3, 4096, 4096, True),
        (16, 4096, 4096, True),
        (256, 4096, 4096, True),
    ):
        assert plan(t, n, k, 128, fp16=fp16) == triton_kernels.split_plan(t, n, k, 128)
    # The split kernel prefetches into L2 on the small layer only.
    assert triton_kernels.split_plan(4, 4096, 4096, 128).prefetch
    assert not triton_kernels.split_plan(4, 11008, 4096, 128).prefetch


def test_rows_plans_are_checked():
    most = triton_kernels.ROWS_MAX_TOKENS
    with pytest.raises(ValueError, match=f"at most {most} tokens"):
        check(most + 1, 8, 64, 32, plan=Plan(16, 4, kernel="rows"))
    with pytest.raises(ValueError, match="power of two"):
        check(1, 8, 64, 32, plan=Plan(16, 6, kernel="rows"))
    with pytest.raises(ValueError, match="kernel must be"):
        check(1, 8, 64, 32, plan=Plan(16, 16, kernel="gemv"))


def test_plans_are_checked():
    with pytest.raises(ValueError, match="block_k"):
        check(1, 24, 256, 32, torch.float16, plan=Plan(16, 16, block_k=192))
    with pytest.raises(ValueError, match="reduce"):
        check(1, 24, 256, 32, torch.float16, plan=Plan(16, 16, split_k=2, reduce="atomic"))


def test_dot_with_several_token_tiles():
    check(40, 24, 96, 32, torch.float16, bias=True, plan=Plan(16, 16), seed=3)
    check(40, 24, 96, 32, torch.bfloat16, bias=False, plan=Plan(32, 16, split_k=2), seed=4)


def test_leading_dims_and_default_allocation():
    qweight, scales, zeros, b = make_layer(24, 64, 32, torch.float16, True, 4)
    x = torch.randn(2, 3, 64).half().to(DEVICE)
    kw = dict(group_size=32, in_features=64, out_features=24)
    got = triton_kernels.int4_gemm(x, qweight, scales, zeros, b, **kw)
    assert got.shape == (2, 3, 24) and got.dtype == torch.float16
    want = reference(x.float(), qweight, scales.float(), zeros, b.float(), **kw)
    assert float((got.float() - want).norm() / want.norm()) < 1e-3


def test_plans_follow_the_shapes():
    plans = {
        (t, n, k): triton_kernels.split_plan(t, n, k, 128, sm_count=132)
        for t in (1, 16)
        for n, k in ((4096, 4096), (11008, 4096), (4096, 11008))
    }
    for (t, n, k), plan in plans.items():
        assert plan.block_t == 16 and plan.reduce == "last"
        tiles = -(-n // plan.block_n)
        # K is split until the programs fill the SMs once (three programs each), no more ...
        assert tiles * plan.split_k <= 3 * 132 < tiles * (plan.split_k + 1)
        # ... with the partial sums under a quarter of the weight bytes.
        assert plan.split_k * t * n * 4 <= n * k / 2 / 4
    # Never into splits of fewer than 2 steps.
    assert triton_kernels.split_plan(16, 64, 384, 128, sm_count=132).split_k == 1
    # 128 contiguous bytes of a row per step where 256 columns divide K, else 128 columns.
    assert triton_kernels.split_plan(1, 4096, 4096, 128).block_k == 256
    assert triton_kernels.split_plan(1, 4096, 4224, 128).block_k == 128
    assert triton_kernels.split_plan(1, 4096, 4096, 256).block_k == 256
    prefill = triton_kernels.default_plan(1024, 11008, 4096, 128, sm_count=132)
    assert prefill.block_t == 64 and prefill.split_k == 1
    assert not triton_kernels.supports(16) and not triton_kernels.supports(96)
    assert all(triton_kernels.supports(g) for g in (32, 64, 128))


# --- real sizes on a GPU --------------------------------------------------------------------

LLAMA_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # [N, K]: o/qkv, up/gate, down


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 16, 300])
def test_gpu_real_sizes(n, k, dtype, tokens):
    check(tokens, n, k, 128, dtype, bias=tokens % 2 == 0, seed=tokens)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "plan",
    [
        Plan(16, 64, split_k=8),
        Plan(16, 128, split_k=16, reduce="last", num_warps=8),
        Plan(16, 128, split_k=3, reduce="last", num_warps=8, block_k=128, max_registers=128),
        Plan(16, 64, split_k=5, reduce="last", num_warps=4, num_stages=4, block_k=128),
        Plan(128, 128, num_warps=8, block_k=128),
        # The L2 prefetch of each program's slice, before the wait: uneven splits (86 steps of 128
        # columns in 5), and one split per row block.
        Plan(16, 64, split_k=5, reduce="last", block_k=128, prefetch=True),
        Plan(16, 64, split_k=1, block_k=256, prefetch=True),
    ],
)
def test_gpu_plan_variants(plan):
    # Three draws each: a race between the splits would move the error from run to run.
    for seed in range(3):
        check(
            16 if plan.block_t == 16 else 200,
            4096,
            11008,
            128,
            torch.float16,
            plan=plan,
            seed=5 + seed,
        )
    assert arrival_counters.all_zero()


@pytest.mark.gpu
def test_gpu_dispatch_and_partial_group():
    from trtc.plugins.int4_gemm import int4_gemm

    n, k, group = 4096, 4096 + 64, 128  # last group: 64 columns
    qweight, scales, zeros, b = make_layer(n, k, group, torch.float16, True, 9)
    x = torch.randn(7, k, device="cuda").half()
    kw = dict(group_size=group, in_features=k, out_features=n)
    got = int4_gemm(x, qweight, scales, zeros, b, **kw)
    want = reference(x.float(), qweight, scales.float(), zeros, b.float(), **kw)
    assert float((got.float() - want).norm() / want.norm()) < 1e-3


@pytest.mark.gpu
def test_gpu_captured_in_a_cuda_graph():
    n, k, group = 4096, 4096, 128
    qweight, scales, zeros, b = make_layer(n, k, group, torch.float16, False, 10)
    x = torch.randn(4, k, device="cuda").half()
    kw = dict(group_size=group, in_features=k, out_features=n)
    eager = triton_kernels.int4_gemm(x, qweight, scales, zeros, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_kernels.int4_gemm(x, qweight, scales, zeros, **kw)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(captured, triton_kernels.int4_gemm(x, qweight, scales, zeros, **kw))
    assert not torch.equal(captured, eager)


# The weights-first kernel's plans that the benchmark times, at the real sizes: K in one piece
# (4096), three pieces (11008: 64 + 16 + 8 groups) or three steps, a partial last group.
GPU_ROWS_CASES = [
    (1, Plan(16, 8, kernel="rows", num_warps=8, num_stages=1, block_k=16384)),
    (1, Plan(16, 4, kernel="rows", num_stages=1, block_k=4096)),
    (2, Plan(16, 4, kernel="rows", num_stages=1, block_k=16384)),
    (5, Plan(16, 2, kernel="rows", num_warps=8, num_stages=1, block_k=2048)),
    (8, Plan(16, 4, kernel="rows", num_warps=8, num_stages=1, block_k=16384)),
    # The half2 products (fp16 activations; bf16 takes the fp32 path): the whole row, steps,
    # three tokens.
    (1, Plan(16, 8, kernel="rows", num_stages=1, block_k=16384, half2=True)),
    (2, Plan(16, 4, kernel="rows", num_stages=1, block_k=2048, half2=True)),
    (3, Plan(16, 4, kernel="rows", num_warps=8, num_stages=1, block_k=16384, half2=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA_SHAPES + [(4096, 4096 + 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(GPU_ROWS_CASES)))
def test_gpu_rows_kernel_real_sizes(n, k, dtype, case):
    tokens, plan = GPU_ROWS_CASES[case]
    check(tokens, n, k, 128, dtype, bias=tokens % 2 == 1, plan=plan, seed=case)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2])
def test_gpu_half2_products_keep_large_activations(tokens):
    # fp16 sums of products overflow at 65504: an outlier channel of a few thousand (as some
    # models' MLP inputs carry) must not reach it (x is taken times 1/16 first).
    n, k = 4096, 4096
    qweight, scales, zeros, _ = make_layer(n, k, 128, torch.float16, False, 31)
    x = torch.randn(tokens, k, device="cuda").half()
    x[:, 7] = 6000.0
    x[:, 8:16] = -3000.0
    plan = Plan(16, 8, kernel="rows", num_stages=1, block_k=4096, half2=True)
    got = triton_kernels.int4_gemm(
        x, qweight, scales, zeros, group_size=128, in_features=k, out_features=n, plan=plan
    )
    exact = x.double() @ dequantize(qweight, scales, zeros, 128).double().T
    assert torch.isfinite(got).all()
    assert float((got.double() - exact).norm() / exact.norm()) < REL_TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4, 16])
def test_gpu_default_decode_chain_in_a_cuda_graph(tokens):
    # Back-to-back calls as a decode step runs them (PDL where the GPU has it), each reading the
    # previous call's output: captured and replayed, bit for bit the eager chain.
    n = k = 4096
    layers = [make_layer(n, k, 128, torch.float16, i % 2 == 0, 20 + i) for i in range(3)]
    kw = dict(group_size=128, in_features=k, out_features=n)

    def chain(x):
        for qweight, scales, zeros, b in layers:
            x = triton_kernels.int4_gemm(x, qweight, scales, zeros, b, **kw) * 0.05
        return x

    x = torch.randn(tokens, k, device="cuda").half()
    chain(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(captured, chain(x), rtol=0, atol=0)
    w = [dequantize(q, s, z, 128) for q, s, z, _ in layers]
    want = x.float()
    for wi, (_, _, _, b) in zip(w, layers):
        want = (want @ wi.T + (b.float() if b is not None else 0)).half().float() * 0.05
    assert float((captured.float() - want).norm() / want.norm()) < 1e-2
