"""Random ragged PagedAttention steps shared by the reference and kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Case:
    query: torch.Tensor  # [T, H*D]
    key: torch.Tensor  # [T, KV*D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, blocks, block_size, KV, D], context already written
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    full_k: list  # per sequence: all its keys [L, KV, D] (context + new)
    full_v: list
    q_parts: list  # per sequence: its queries [n_new, H, D]

    def args(self):
        return (
            self.query,
            self.key,
            self.value,
            self.kv_cache,
            self.slot_mapping,
            self.block_tables,
            self.context_lens,
            self.query_start_loc,
        )


def make_case(
    seqs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    seed: int,
    dtype=torch.float32,
    padding: int = 1,
    device="cpu",
) -> Case:
    """``seqs`` = (cached tokens, new tokens) per sequence; ``padding`` tokens with slot -1 at the
    end."""
    g = torch.Generator().manual_seed(seed)
    D = head_dim
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, D)
    free = torch.randperm(num_blocks, generator=g).tolist()
    full_k, full_v, tables, slots, q_parts, starts, lens, new_k, new_v = (
        [],
        [],
        [],
        [],
        [],
        [0],
        [],
        [],
        [],
    )
    for cached, new in seqs:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        k = torch.randn(total, kv_heads, D, generator=g)
        v = torch.randn(total, kv_heads, D, generator=g)
        for pos in range(cached):
            cache[0, blocks[pos // block_size], pos % block_size] = k[pos]
            cache[1, blocks[pos // block_size], pos % block_size] = v[pos]
        slots += [
            blocks[p // block_size] * block_size + p % block_size for p in range(cached, total)
        ]
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        full_k.append(k)
        full_v.append(v)
        q_parts.append(torch.randn(new, heads, D, generator=g))
        tables.append(blocks)
        starts.append(starts[-1] + new)
        lens.append(total)
    width = max(map(len, tables))
    q = torch.cat(q_parts + [torch.randn(padding, heads, D, generator=g)])
    k_in = torch.cat(new_k + [torch.randn(padding, kv_heads, D, generator=g)])
    v_in = torch.cat(new_v + [torch.randn(padding, kv_heads, D, generator=g)])
    T = len(q)
    to = dict(device=device)
    return Case(
        q.view(T, -1).to(dtype).to(**to),
        k_in.view(T, -1).to(dtype).to(**to),
        v_in.view(T, -1).to(dtype).to(**to),
        cache.to(dtype).to(**to),
        torch.tensor(slots + [-1] * padding, **to),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, **to),
        torch.tensor(lens, dtype=torch.int32, **to),
        torch.tensor(starts, dtype=torch.int32, **to),
        full_k,
        full_v,
        q_parts,
    )
