"""Turn per-sequence work into the tensors of one step (the step contract, `trtc.compiler.contract`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceWork:
    """One sequence's share of a step: its new tokens, how many tokens it already has cached,
    and its block table (long enough for ``num_cached + len(new_tokens)`` tokens)."""
    new_tokens: list[int]
    num_cached: int
    block_table: list[int]


def make_step(work: list[SequenceWork], block_size: int) -> dict[str, torch.Tensor]:
    input_ids, positions, slots, starts, context_lens, logits_indices = [], [], [], [0], [], []
    for w in work:
        total = w.num_cached + len(w.new_tokens)
        if len(w.block_table) * block_size < total:
            raise ValueError(f"block table of {len(w.block_table)} blocks cannot hold {total} tokens")
        for i, tok in enumerate(w.new_tokens):
            pos = w.num_cached + i
            input_ids.append(tok)
            positions.append(pos)
            slots.append(w.block_table[pos // block_size] * block_size + pos % block_size)
        starts.append(len(input_ids))
        context_lens.append(total)
        logits_indices.append(len(input_ids) - 1)
    max_blocks = max(len(w.block_table) for w in work)
    tables = [w.block_table + [0] * (max_blocks - len(w.block_table)) for w in work]
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.int64),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "block_tables": torch.tensor(tables, dtype=torch.int32),
        "context_lens": torch.tensor(context_lens, dtype=torch.int32),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "logits_indices": torch.tensor(logits_indices, dtype=torch.int64),
    }
