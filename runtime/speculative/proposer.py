"""What a proposer is: something that guesses a sequence's next tokens cheaply, for the target
model to verify in one step (`verify.py`). What it returns is a `Proposal` (`runtime/core/`,
where the sequence and the scheduler hold it). Trained heads (EAGLE, Medusa) fit the same
interface: their proposals come from the target's hidden states, which a proposer may be handed
later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from trtc.runtime.core.proposal import Proposal

if TYPE_CHECKING:
    from trtc.runtime.core.sequence import Sequence


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
