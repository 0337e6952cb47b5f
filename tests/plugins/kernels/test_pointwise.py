"""The Triton elementwise kernels (RMSNorm, rotary, SwiGLU) against the torch spelling of the
same ONNX ops. Triton's CPU interpreter runs them where there is no GPU."""

from __future__ import annotations

import pytest
import torch

pointwise = pytest.importorskip("trtc.plugins.kernels.pointwise", reason="triton is not installed")
from trtc.runtime.executors import torch_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE == "cuda" else [])
# Low-precision results may round differently (one fused rounding against torch's per-op ones).
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=1.6e-2),
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    want = torch_ops.rms_norm([x, w], {"epsilon": 1e-5, "stash_type": 1})[0]
    got = pointwise.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5).cpu()
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype):
    g = torch.Generator().manual_seed(1)
    heads, D, T = 3, 16, 11
    x = torch.randn(1, T, heads * D, generator=g).to(dtype)
    cos, sin = (
        torch.randn(64, D // 2, generator=g).to(dtype),
        torch.randn(64, D // 2, generator=g).to(dtype),
    )
    pos = torch.randint(0, 64, (1, T), generator=g)
    attrs = {"num_heads": heads, "interleaved": 0}
    want = torch_ops._rotary([x, cos, sin, pos], attrs)[0]
    got = pointwise.rotary(
        x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), pos.to(DEVICE), heads
    ).cpu()
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    x = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = torch_ops.swiglu([x], {})[0]
    got = pointwise.swiglu(x.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, **TOL[dtype])
