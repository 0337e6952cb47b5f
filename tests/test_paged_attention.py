"""The PagedAttention reference against plain dense causal attention, on random ragged batches."""
from __future__ import annotations

import pytest
import torch

from trtc.plugins.paged_attention.reference import paged_attention


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
    torch.manual_seed(heads * 100 + block_size + window)
    D, num_blocks = 8, 64
    # (cached tokens, new tokens): decode, prefill, prefill chunk after context, block-edge cases
    seqs = [(9, 1), (0, 7), (block_size * 2 - 1, 5), (block_size, block_size + 1), (3, 1)]
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, D)
    free = torch.randperm(num_blocks).tolist()
    full_k, full_v, tables, slots, q_parts, starts, lens = [], [], [], [], [], [0], []
    new_k, new_v = [], []
    for cached, new in seqs:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        k = torch.randn(total, kv_heads, D)
        v = torch.randn(total, kv_heads, D)
        for pos in range(cached):   # context already in the cache
            cache[0, blocks[pos // block_size], pos % block_size] = k[pos]
            cache[1, blocks[pos // block_size], pos % block_size] = v[pos]
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        full_k.append(k)
        full_v.append(v)
        q_parts.append(torch.randn(new, heads, D))
        tables.append(blocks)
        starts.append(starts[-1] + new)
        lens.append(total)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    # One padding token at the end: slot -1, owned by no sequence.
    q = torch.cat(q_parts + [torch.randn(1, heads, D)])
    k_in = torch.cat(new_k + [torch.randn(1, kv_heads, D)])
    v_in = torch.cat(new_v + [torch.randn(1, kv_heads, D)])
    slot_mapping = torch.tensor(slots + [-1])
    before = cache.clone()
    out, cache_out = paged_attention(
        q.view(len(q), -1), k_in.view(len(q), -1), v_in.view(len(q), -1), cache, slot_mapping,
        block_tables, torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=D, scale=D ** -0.5, sliding_window=window)
    assert cache_out.data_ptr() == cache.data_ptr(), "the cache is updated in place"
    out = out.view(len(q), heads, D)
    for i, (cached, new) in enumerate(seqs):
        want = dense_attention(q_parts[i], full_k[i], full_v[i], D ** -0.5, window)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[-1], torch.zeros(heads, D)), "padding tokens produce zeros"
    # The cache is what it was, with exactly the new tokens' slots holding their K/V.
    expected = before.clone()
    expected.view(2, -1, kv_heads, D)[0, slot_mapping[:-1]] = k_in[:-1]
    expected.view(2, -1, kv_heads, D)[1, slot_mapping[:-1]] = v_in[:-1]
    assert torch.equal(cache, expected)


def test_fp16_inputs_keep_dtype_and_cache_dtype():
    torch.manual_seed(0)
    cache = torch.zeros(2, 4, 4, 1, 8, dtype=torch.float16)
    q, k, v = torch.randn(3, 16).half(), torch.randn(3, 8).half(), torch.randn(3, 8).half()
    out, _ = paged_attention(q, k, v, cache, torch.tensor([4, 5, 6]), torch.tensor([[1, 2]], dtype=torch.int32),
                             torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
                             num_heads=2, num_kv_heads=1, head_dim=8, scale=0.35)
    assert out.dtype == torch.float16 and cache.dtype == torch.float16
    assert torch.equal(cache[0, 1, :3, 0], k)


def test_rejects_more_new_tokens_than_context():
    cache = torch.zeros(2, 2, 4, 1, 4)
    with pytest.raises(ValueError, match="context_len"):
        paged_attention(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4), cache,
                        torch.tensor([0, 1, 2]), torch.tensor([[0]], dtype=torch.int32),
                        torch.tensor([2], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
                        num_heads=1, num_kv_heads=1, head_dim=4, scale=0.5)
