"""What a sequence carries into a step when speculative decoding drafts for it.

A proposal is ``k`` draft tokens and, for a proposer that samples them, the distribution each
was drawn from (the rejection rule needs it to keep the target's distribution exactly). A
proposer that picks its tokens deterministically (n-gram lookup, a greedy draft) gives no
distribution: its draws are point masses. The type lives in the core because the sequence and
the scheduler hold it; the proposers (`runtime/speculative/`) make it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one sequence; ``probs[i]`` (``[k, vocab]``, None for a deterministic
    proposer) is the distribution ``tokens[i]`` was drawn from."""

    tokens: list[int]
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)
