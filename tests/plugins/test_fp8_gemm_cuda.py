"""The CUDA Fp8Gemm (`plugins/fp8_gemm/cuda.py`) against the reference. Each ``torch._scaled_mm``
recipe's arithmetic is checked here on the CPU where this torch build runs ``_scaled_mm`` on
CPU tensors; the dispatch, the recipe a GPU accepts and the fallback shapes run on a GPU (marker
`gpu`)."""

from __future__ import annotations

import pytest
import torch

from trtc.plugins.fp8_gemm import cuda, fp8_gemm
from trtc.plugins.fp8_gemm.reference import E4M3_MAX, to_fp8
from trtc.plugins.fp8_gemm.reference import fp8_gemm as reference

REL_TOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# Hopper's FP8 matrix units keep partial sums in less than fp32 precision, whatever the output
# dtype: on an H200 an fp32-output product was 1.25e-4 .. 1.38e-4 (relative norm) from the fp64
# formula on these shapes, so an fp32 result can be no closer than that.
FP8_MMA_REL_TOL = 5e-4


def make_layer(tokens, k, n, dtype, bias, seed, device="cpu"):
    """Activations (a few past the calibrated range, to exercise saturation), an E4M3 weight,
    per-channel weight scales, a static input scale and a bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) * 2
    x[0, : min(k, 4)] = torch.tensor([1e3, -1e3, 500.0, -7.0])[: min(k, 4)]
    weight = to_fp8(torch.randn(n, k, generator=g) * 100)
    weight_scale = torch.rand(n, generator=g) * 0.01 + 0.001
    input_scale = torch.tensor(float(x[1:].abs().max()) / E4M3_MAX if tokens > 1 else 0.05)
    b = torch.randn(n, generator=g) if bias else None
    tensors = (x.to(dtype), weight, weight_scale, input_scale, None if b is None else b.to(dtype))
    return tuple(t.to(device) if t is not None else None for t in tensors)


def exact(x, weight, weight_scale, input_scale, bias):
    """The reference's formula in fp64 (before the cast to x's dtype)."""
    s = input_scale.double()
    x_q = to_fp8(x.float() / input_scale.float()).double() * s
    y = x_q @ (weight.double() * weight_scale.double()[:, None]).T
    return y + (bias.double() if bias is not None else 0)


def rel_err(got, want):
    return float((got.double() - want).norm() / want.norm())


def cpu_scaled_mm_works() -> bool:
    try:
        a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
        return True
    except Exception:
        return False


@pytest.mark.skipif(not cpu_scaled_mm_works(), reason="this torch build has no CPU _scaled_mm")
@pytest.mark.parametrize("recipe", cuda.RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_each_recipe_computes_the_reference(recipe, dtype, bias):
    x, w, ws, s_in, b = make_layer(6, 64, 48, dtype, bias, seed=3)
    got = cuda._scaled_mm(recipe, cuda.quantize_input(x, s_in), w, ws, s_in, b, dtype)
    assert got.dtype == dtype and got.shape == (6, 48)
    assert rel_err(got, exact(x, w, ws, s_in, b)) < REL_TOL[dtype]
    torch.testing.assert_close(got, reference(x, w, ws, s_in, b, in_features=64, out_features=48))


def test_cpu_tensors_take_the_reference():
    x, w, ws, s_in, b = make_layer(3, 40, 24, torch.float32, True, seed=4)
    assert not cuda.uses_scaled_mm(x, w)
    got = fp8_gemm(x, w, ws, s_in, b, in_features=40, out_features=24)
    assert torch.equal(got, reference(x, w, ws, s_in, b, in_features=40, out_features=24))


# --- on a GPU -------------------------------------------------------------------------------

SHAPES = [(1, 4096, 4096), (7, 4096, 11008), (16, 11008, 4096), (300, 2048, 2048)]  # T, K, N
ODD_SHAPES = [(5, 100, 64), (3, 64, 24), (1, 72, 40)]  # K or N not a multiple of 16


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_scaled_mm_matches_reference(tokens, k, n, dtype):
    bias = tokens % 2 == 1
    x, w, ws, s_in, b = make_layer(tokens, k, n, dtype, bias, seed=tokens, device="cuda")
    kw = dict(in_features=k, out_features=n)
    got = fp8_gemm(x, w, ws, s_in, b, **kw)  # the plugin's dispatch
    assert got.device.type == "cuda" and got.dtype == dtype and not torch.isnan(got).any()
    if cuda.has_fp8_matmul(x.device):
        recipe = cuda.recipe_for(x, b)
        print(f"{dtype} bias={bias}: recipe {recipe}")
        assert recipe in cuda.RECIPES, "torch._scaled_mm took none of the recipes"
    tol = max(REL_TOL[dtype], FP8_MMA_REL_TOL) if cuda.uses_scaled_mm(x, w) else REL_TOL[dtype]
    e_exact, e_ref = (
        rel_err(got, exact(x, w, ws, s_in, b)),
        rel_err(got, reference(x, w, ws, s_in, b, **kw)),
    )
    print(
        f"{dtype} T={tokens} K={k} N={n}: rel err {e_exact:.2e} vs fp64, "
        f"{e_ref:.2e} vs the reference"
    )
    assert e_exact < tol, f"rel err {e_exact:.2e} vs the fp64 formula"
    # Against the reference's fp32 arithmetic by METHOD.md's norm: elementwise, Hopper's FP8
    # matrix units (reduced-precision partial sums) differ by a few output ulps here and there.
    assert e_ref < tol, f"rel err {e_ref:.2e} vs the reference"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,k,n", ODD_SHAPES)
def test_gpu_odd_shapes_fall_back_to_the_reference(tokens, k, n):
    x, w, ws, s_in, b = make_layer(tokens, k, n, torch.float16, True, seed=k, device="cuda")
    assert not cuda.uses_scaled_mm(x, w)
    got = fp8_gemm(x, w, ws, s_in, b, in_features=k, out_features=n)
    want = reference(x, w, ws, s_in, b, in_features=k, out_features=n)
    assert torch.equal(got, want)
    assert rel_err(got, exact(x, w, ws, s_in, b)) < REL_TOL[torch.float16]


@pytest.mark.gpu
def test_gpu_saturates_like_the_reference():
    # Every activation is far past the calibrated range: all of x_q is +-448.
    x, w, ws, s_in, _ = make_layer(4, 256, 128, torch.bfloat16, False, seed=9, device="cuda")
    x = x.sign() * 1e4
    got = fp8_gemm(x, w, ws, s_in, None, in_features=256, out_features=128)
    assert torch.isfinite(got).all()
    assert rel_err(got, exact(x, w, ws, s_in, None)) < REL_TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_leading_dims_and_cuda_graph():
    x, w, ws, s_in, b = make_layer(6, 512, 256, torch.float16, True, seed=10, device="cuda")
    x = x.view(2, 3, 512)
    kw = dict(in_features=512, out_features=256)
    eager = fp8_gemm(x, w, ws, s_in, b, **kw)  # first call picks the recipe
    assert eager.shape == (2, 3, 256)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_gemm(x, w, ws, s_in, b, **kw)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(captured, fp8_gemm(x, w, ws, s_in, b, **kw))
    assert not torch.equal(captured, eager)
