"""The split-K GEMM of 16-64-row decode projections (`plugins/kernels/split_k_gemm.py`) against
the fp32 product, in Triton's CPU interpreter where there is no GPU (on a GPU, in fp16 and bf16
and inside a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from harness.sm90_compile import run_probe
from trtc.plugins.kernels import arrival_counters

split_k = pytest.importorskip("trtc.plugins.kernels.split_k_gemm", reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def product(rows, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + 8, generator=g)[:, :k]  # a strided view, as a sliced output
    w = torch.randn(n, k, generator=g) * 0.1
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,n,k,overrides",
    [
        (1, 40, 96, {}),  # the plan's split: K of two steps, two chunks
        (8, 40, 96, {"splits": 1}),  # no partials: the tile written at once
        (5, 72, 300, {"splits": 3}),  # K not a multiple of a chunk; N not of a tile
        (16, 64, 256, {"splits": 4, "block_n": 32}),
        (33, 96, 200, {"splits": 2}),
        (64, 50, 640, {"splits": 16}),  # more splits than chunks of 64: clamped, none empty
    ],
)
def test_split_k_gemm_matches_the_product(dtype, rows, n, k, overrides):
    x, w = product(rows, n, k, seed=rows * 100 + k)
    want = x.to(dtype).float() @ w.to(dtype).float().T
    got = split_k.split_k_gemm(x.to(DEVICE, dtype), w.to(DEVICE, dtype), **overrides)
    assert got.dtype == dtype and got.shape == (rows, n)
    err = float((got.float().cpu() - want).norm() / want.norm())
    assert err < TOL[dtype], err
    assert arrival_counters.all_zero()  # the last arrival reset every tile's counter


def test_the_plan_fills_the_gpu_and_cuts_k_in_whole_steps():
    for rows, n, k in [(64, 4096, 4096), (64, 6144, 4096), (16, 28672, 4096), (64, 4096, 14336)]:
        p = split_k.plan(rows, n, k)
        assert p["tiles"] * p["splits"] >= 132, p  # at least one program an SM
        assert p["chunk"] % p["block_k"] == 0 and (p["splits"] - 1) * p["chunk"] < k, p
    assert split_k.plan(64, 4096, 4096)["splits"] == 8


def test_supports_only_what_the_kernel_takes():
    x = torch.zeros(64, 128, dtype=torch.float16)
    w = torch.zeros(32, 128, dtype=torch.float16)
    assert split_k.supports(x, w)
    assert not split_k.supports(torch.zeros(65, 128, dtype=torch.float16), w)  # > MAX_ROWS
    assert not split_k.supports(x.float(), w.float())
    assert not split_k.supports(x, w.t().contiguous().t())  # weight not contiguous
    assert not split_k.supports(x[:, :64], w)  # K differs


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336)])
def test_gpu_real_sizes_in_a_cuda_graph(n, k):
    """The 8B projections at 64 rows: the plan's splits merged by the last arrival, the same
    output on every replay of a CUDA graph, within fp16 rounding of cuBLAS."""
    x, w = (t.to("cuda", torch.float16) for t in product(64, n, k, seed=n + k))
    want = torch.nn.functional.linear(x, w)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        split_k.split_k_gemm(x, w)  # compiled, and the stream's counters made, before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = split_k.split_k_gemm(x, w)
    for _ in range(3):
        got.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert arrival_counters.all_zero()


SPILL_PROBE = r"""
from trtc.plugins.kernels import split_k_gemm as sk

# The 8B model's o projection (64 x 64 tiles) and gate/up (64 x 128) at 64 rows.
for rows, n, k in [(64, 4096, 4096), (64, 28672, 4096)]:
    p = sk.plan(rows, n, k)
    consts = dict(BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], BLOCK_K=p["block_k"],
                  CHUNK=p["chunk"], SPLITS=p["splits"], PDL=True)
    sig = {"x_ptr": "*fp16", "w_ptr": "*fp16", "part_ptr": "*fp32", "y_ptr": "*fp16",
           "counter_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_x": "i32"}
    asm = compile_sm90(sk._split_k_gemm, sig, consts, num_warps=p["num_warps"],
                       num_stages=p["num_stages"])
    registers, stores, loads = ptxas_report(asm["ptx"])
    print(rows, n, k, p["block_n"], p["num_warps"], "wgmma" in asm["ptx"], f"{stores}/{loads}")
"""


def test_launches_compile_for_sm90_on_the_tensor_cores_without_spills():
    """The plan's launches at 64 rows, compiled for sm_90 (ptxas -v): wgmma, and no spill (64 x
    128 tiles spilled 1 KB a thread at 4 warps, hence 8 there)."""
    lines = run_probe(SPILL_PROBE)
    assert len(lines) == 2, lines
    for line in lines:
        assert line.split()[-2:] == ["True", "0/0"], line
