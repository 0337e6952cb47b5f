"""The Triton PagedAttention kernels against the reference. Without a GPU they run in Triton's
CPU interpreter (TRITON_INTERPRET=1, set in conftest) at small sizes; on a GPU (marker `gpu`)
at real sizes and in fp16/bf16."""
from __future__ import annotations

import pytest
import torch

from attention_cases import make_case
from trtc.plugins.paged_attention.reference import paged_attention as reference_attention

triton_kernels = pytest.importorskip("trtc.plugins.paged_attention.triton_kernels",
                                     reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check(seqs, heads, kv_heads, D, block_size, window=0, dtype=torch.float32, splits=None, seed=0,
          num_blocks=64, atol=2e-5):
    ref = make_case(seqs, heads, kv_heads, D, block_size, num_blocks, seed, dtype=torch.float32)
    kern = make_case(seqs, heads, kv_heads, D, block_size, num_blocks, seed, dtype=dtype, device=DEVICE)
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=D, scale=D ** -0.5, sliding_window=window)
    want, want_cache = reference_attention(*ref.args(), **kw)
    got, got_cache = triton_kernels.paged_attention(*kern.args(), num_splits=splits, **kw)
    n_real = int(ref.query_start_loc[-1])
    err = (got[:n_real].float().cpu() - want[:n_real]).norm() / want[:n_real].norm()
    assert not torch.isnan(got[:n_real]).any()
    assert err < atol, f"relative error {err:.2e}"
    torch.testing.assert_close(got_cache.float().cpu(), want_cache.to(dtype).float(), atol=0, rtol=0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_prefill_and_decode(heads, kv_heads, block_size):
    seqs = [(9, 1), (0, 7), (block_size * 2 - 1, 5), (block_size, block_size + 1), (3, 1)]
    check(seqs, heads, kv_heads, 16, block_size, seed=heads + block_size)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_decode_split_k(splits):
    seqs = [(70, 1), (5, 1), (33, 1), (0, 1)]
    check(seqs, 8, 2, 16, 16, splits=splits, seed=splits, num_blocks=32)


def test_sliding_window():
    check([(40, 1), (10, 12), (0, 30)], 4, 2, 16, 8, window=9, seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_real_sizes(dtype):
    seqs = [(2047, 1)] * 8 + [(0, 300), (500, 129), (17, 1)]
    check(seqs, 32, 4, 64, 16, dtype=dtype, seed=11, num_blocks=2048, atol=1e-2)
