"""The dense GEMV of decode steps (`plugins/kernels/gemv.py`) against the fp32 product, in Triton's
CPU interpreter where there is no GPU; on a GPU also with programmatic dependent launch, inside
a CUDA graph, against the same chain launched without it."""

from __future__ import annotations

import pytest
import torch

gemv = pytest.importorskip("trtc.plugins.kernels.gemv", reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens,n,k,bias", [(1, 37, 96, False), (2, 64, 128, True), (3, 20, 300, True)]
)
def test_gemv_matches_the_product(dtype, tokens, n, k, bias):
    g = torch.Generator().manual_seed(tokens * 1000 + k)
    x = torch.randn(tokens, k + 5, generator=g)[:, :k]  # a strided view, as a sliced output
    w = torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g) if bias else None
    want = x @ w.T + (b if bias else 0)
    got = gemv.gemv(
        x.to(DEVICE, dtype),
        w.to(DEVICE, dtype),
        b.to(DEVICE, dtype) if bias else None,
        rows=8 if k <= 128 else None,
    )
    assert got.dtype == dtype and got.shape == (tokens, n)
    err = float((got.float().cpu() - want).norm() / want.norm())
    assert err < TOL[dtype], err


def test_supports_only_what_the_kernel_takes():
    x = torch.zeros(1, 64, dtype=torch.float16)
    w = torch.zeros(8, 64, dtype=torch.float16)
    assert not gemv.supports(x, w)  # not on a GPU
    if DEVICE == "cuda":
        xc, wc = x.cuda(), w.cuda()
        assert gemv.supports(xc, wc)
        assert not gemv.supports(xc.repeat(gemv.max_tokens() + 1, 1), wc)
        assert not gemv.supports(xc.float(), wc.float())
        assert not gemv.supports(
            torch.zeros(1, 2 * gemv.TILE, device="cuda", dtype=torch.float16),
            torch.zeros(8, 2 * gemv.TILE, device="cuda", dtype=torch.float16),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_pdl_chain_in_a_cuda_graph_equals_plain_launches(dtype):
    """Dependent GEMVs, RMSNorms and SwiGLUs captured with PDL give bit for bit what the same chain
    gives launched one after the other: every kernel waited for its inputs."""
    from trtc.plugins.kernels import pdl, pointwise

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, inner = 512, 1376
    layers = [
        (
            torch.randn(2 * inner, hidden, generator=g, device="cuda", dtype=dtype) * 0.05,
            torch.randn(hidden, inner, generator=g, device="cuda", dtype=dtype) * 0.05,
            torch.rand(hidden, generator=g, device="cuda", dtype=dtype) + 0.5,
        )
        for _ in range(12)
    ]
    x = torch.randn(1, hidden, generator=g, device="cuda", dtype=dtype)

    def step():
        h = x
        for up, down, norm in layers:
            y = pointwise.rms_norm(h, norm, 1e-5)
            h = h + gemv.gemv(pointwise.swiglu(gemv.gemv(y, up)), down)
        return h

    was = pdl.set_enabled(False)
    try:
        want = step()
        pdl.set_enabled(True)
        assert pdl.enabled(x.device) == (torch.cuda.get_device_capability()[0] >= 9)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
    finally:
        pdl.set_enabled(was)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,bias", [(1, False), (2, True)])
def test_swiglu_gemv_matches_the_product_then_swiglu(dtype, tokens, bias):
    """``swiglu``: the GEMV's output is SwiGLU of the product, as the two ops compute it."""
    from trtc.runtime.executors import torch_ops

    g = torch.Generator().manual_seed(tokens)
    k, n = 176, 96
    x = torch.randn(tokens, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    product = (x.float() @ w.float().T + (b.float() if bias else 0)).to(dtype)
    want = torch_ops.swiglu([product], {})[0].float()
    got = gemv.gemv(x, w, b, swiglu=True)
    assert got.shape == (tokens, n // 2) and got.dtype == dtype
    err = float((got.float() - want).norm() / want.norm())
    assert err < TOL[dtype], err
