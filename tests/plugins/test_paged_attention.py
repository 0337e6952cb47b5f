"""The PagedAttention reference against plain dense causal attention, on random ragged batches."""

from __future__ import annotations

import pytest
import torch

from harness.attention_cases import make_case
from trtc.plugins.paged_attention.reference import from_cache, paged_attention, to_cache


def dense_attention(q, k, v, scale, window=0):
    """q [n, H, D] for the last n positions of k/v [L, KV, D]."""
    n, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, 1)
    v = v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(length - n, length)[:, None]
    kpos = torch.arange(length)[None, :]
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [0, 5])
def test_ragged_step_matches_dense(heads, kv_heads, block_size, window):
    D = 8
    # (cached tokens, new tokens): decode, prefill, prefill chunk after context, block-edge cases
    seqs = [(9, 1), (0, 7), (block_size * 2 - 1, 5), (block_size, block_size + 1), (3, 1)]
    c = make_case(seqs, heads, kv_heads, D, block_size, 64, seed=heads * 100 + block_size + window)
    before = c.kv_cache.clone()
    out, cache_out = paged_attention(
        *c.args(),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=D,
        scale=D**-0.5,
        sliding_window=window,
    )
    assert cache_out.data_ptr() == c.kv_cache.data_ptr(), "the cache is updated in place"
    out = out.view(len(c.query), heads, D)
    starts = c.query_start_loc.tolist()
    for i in range(len(seqs)):
        want = dense_attention(c.q_parts[i], c.full_k[i], c.full_v[i], D**-0.5, window)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[-1], torch.zeros(heads, D)), "padding tokens produce zeros"
    # The cache is what it was, with exactly the new tokens' slots holding their K/V.
    expected = before.clone()
    new = c.slot_mapping[:-1]
    expected.view(2, -1, kv_heads, D)[0, new] = c.key[:-1].view(-1, kv_heads, D)
    expected.view(2, -1, kv_heads, D)[1, new] = c.value[:-1].view(-1, kv_heads, D)
    assert torch.equal(c.kv_cache, expected)


def test_fp16_inputs_keep_dtype_and_cache_dtype():
    torch.manual_seed(0)
    cache = torch.zeros(2, 4, 4, 1, 8, dtype=torch.float16)
    q, k, v = torch.randn(3, 16).half(), torch.randn(3, 8).half(), torch.randn(3, 8).half()
    out, _ = paged_attention(
        q,
        k,
        v,
        cache,
        torch.tensor([4, 5, 6]),
        torch.tensor([[1, 2]], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32),
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        scale=0.35,
    )
    assert out.dtype == torch.float16 and cache.dtype == torch.float16
    assert torch.equal(cache[0, 1, :3, 0], k)


def test_rejects_more_new_tokens_than_context():
    cache = torch.zeros(2, 2, 4, 1, 4)
    with pytest.raises(ValueError, match="context_len"):
        paged_attention(
            torch.randn(3, 4),
            torch.randn(3, 4),
            torch.randn(3, 4),
            cache,
            torch.tensor([0, 1, 2]),
            torch.tensor([[0]], dtype=torch.int32),
            torch.tensor([2], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32),
            num_heads=1,
            num_kv_heads=1,
            head_dim=4,
            scale=0.5,
        )


def fp8_case(seqs, heads, kv_heads, D, block_size, seed, k_scale, v_scale):
    """A ragged case whose cached context is stored in an FP8 cache with the given scales."""
    c = make_case(seqs, heads, kv_heads, D, block_size, 64, seed=seed)
    fp8 = torch.empty(c.kv_cache.shape, dtype=torch.float8_e4m3fn)
    fp8[0], fp8[1] = (
        to_cache(c.kv_cache[0], fp8.dtype, k_scale),
        to_cache(c.kv_cache[1], fp8.dtype, v_scale),
    )
    c.kv_cache = fp8
    return c


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_fp8_cache_is_attention_over_the_rounded_keys_and_values(heads, kv_heads):
    D, k_scale, v_scale = 8, 0.02, 0.015  # far from 1 (a missed scale shows), no saturation
    seqs = [(9, 1), (0, 7), (13, 5), (3, 1)]
    c = fp8_case(seqs, heads, kv_heads, D, 4, 7, k_scale, v_scale)
    out, cache = paged_attention(
        *c.args(),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=D,
        scale=D**-0.5,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    assert cache.dtype == torch.float8_e4m3fn
    out = out.view(len(c.query), heads, D)
    starts = c.query_start_loc.tolist()
    for i in range(len(seqs)):
        k = from_cache(to_cache(c.full_k[i], torch.float8_e4m3fn, k_scale), k_scale)
        v = from_cache(to_cache(c.full_v[i], torch.float8_e4m3fn, v_scale), v_scale)
        want = dense_attention(c.q_parts[i], k, v, D**-0.5)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], want, atol=1e-5, rtol=1e-5)
        exact = dense_attention(c.q_parts[i], c.full_k[i], c.full_v[i], D**-0.5)
        assert 1e-4 < float((want - exact).abs().max()) < 0.2  # E4M3: ~3 significant bits
    slots = c.slot_mapping[:-1].long()
    stored = cache[0].view(-1, kv_heads, D)[slots]
    assert torch.equal(
        stored.view(torch.uint8),
        to_cache(c.key[:-1].view(-1, kv_heads, D), torch.float8_e4m3fn, k_scale).view(torch.uint8),
    )


def test_fp8_cache_saturates_and_scales_are_checked():
    big = torch.tensor([1e6, -1e6, 3.0])
    assert to_cache(big, torch.float8_e4m3fn, 1.0).float().tolist() == [448.0, -448.0, 3.0]
    cache = torch.zeros(2, 2, 4, 1, 4)
    args = (
        torch.randn(1, 4),
        torch.randn(1, 4),
        torch.randn(1, 4),
        cache,
        torch.tensor([0]),
        torch.tensor([[0]], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="FP8 KV cache only"):
        paged_attention(*args, num_heads=1, num_kv_heads=1, head_dim=4, scale=0.5, k_scale=0.1)
    with pytest.raises(ValueError, match="positive"):
        paged_attention(
            *args[:3],
            cache.to(torch.float8_e4m3fn),
            *args[4:],
            num_heads=1,
            num_kv_heads=1,
            head_dim=4,
            scale=0.5,
            k_scale=0.0,
        )
