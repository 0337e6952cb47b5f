"""Random INT4 layers for the Int4Gemm kernel tests, on the device the tests run on."""

from __future__ import annotations

import torch

from trtc.plugins.int4_gemm.reference import pack_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_layer(n, k, group, dtype, bias, seed, device=DEVICE):
    """Random packed weight (scales 0.001..0.021, zeros 0..15) and bias, made on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8, device=device)
    scales = (torch.rand(n, groups, generator=g, device=device) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8, device=device)
    b = torch.randn(n, generator=g, device=device).to(dtype) if bias else None
    return pack_int4(q), scales, zeros, b
