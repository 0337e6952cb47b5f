"""What a proposer is: something that guesses a sequence's next tokens cheaply, for the target
model to verify in one step (`verify.py`).

A proposal is ``k`` draft tokens and, for a proposer that samples them, the distribution each
was drawn from (the rejection rule needs it to keep the target's distribution exactly). A
proposer that picks its tokens deterministically (n-gram lookup, a greedy draft) gives no
distribution: its draws are point masses. Trained heads (EAGLE, Medusa) fit the same interface:
their proposals come from the target's hidden states, which a proposer may be handed later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from trtc.runtime.core.sequence import Sequence


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one sequence; ``probs[i]`` (``[k, vocab]``, None for a deterministic
    proposer) is the distribution ``tokens[i]`` was drawn from."""

    tokens: list[int]
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class Proposer(Protocol):
    name: str

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Proposal]:
        """At most ``max_tokens[i]`` draft tokens to follow ``seqs[i]``'s tokens (an empty
        proposal: nothing worth verifying)."""

    def verified(self, seq: Sequence) -> None:
        """``seq`` has its verified tokens appended (a proposer with state per sequence rolls
        it back to them)."""

    def finished(self, seq: Sequence) -> None:
        """``seq`` is done or preempted: drop what the proposer holds for it."""
