"""When the running sequences get drafts, how many, and the back-off from drafts that fail.

Speculation pays while a step is bound by reading the weights (few sequences): verifying ``k``
drafts costs about one step and may emit ``k + 1`` tokens. With many sequences running the step
is bound by compute, and drafts cost more than the tokens they save, so speculation is off
above ``max_batch`` running sequences. A sequence whose drafts keep failing (nothing proposed,
or nothing accepted) is paused, for a time that doubles with each failure in a row: a failed
verification costs a step, and while any sequence speculates the next step cannot be queued
ahead of this one's tokens (its proposals need them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trtc.runtime.core.sequence import Sequence

if TYPE_CHECKING:
    from trtc.runtime.core.proposal import Proposal
    from trtc.runtime.engine.outputs import EngineCounters
    from trtc.runtime.speculative.proposer import Proposer


class SpeculationPolicy:
    # A sequence whose drafts failed n times in a row waits 2**n steps (at most this many)
    # before it is proposed for again.
    MAX_PAUSE = 64

    def __init__(
        self,
        proposer: Proposer | None,
        num_tokens: int,
        max_batch: int,
        max_seq_len: int,
        counters: EngineCounters,
    ):
        """``num_tokens``: drafts a sequence verifies per step, at most; ``counters``: the
        engine's, whose step count paces the back-off and whose speculation counters this
        policy keeps."""
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.counters = counters

    def active(self, running: list[Sequence]) -> bool:
        """Whether the running sequences get drafts: a proposer, at most ``max_batch`` of them
        running, one that may speculate now. While it is off, the engine queues the next step
        before this one's tokens are read (async scheduling)."""
        return (
            self.proposer is not None
            and 0 < len(running) <= self.max_batch
            and any(self._may_speculate(s) for s in running)
        )

    def propose(self, running: list[Sequence]) -> None:
        """Give running decoders drafts to verify in the next step (`Sequence.proposal`)."""
        if not self.active(running):
            return
        decoding = [
            s
            for s in running
            if self._may_speculate(s) and s.num_uncomputed_tokens == 1 and s.num_output_tokens
        ]
        if not decoding:
            return
        limits = [self._draft_limit(s) for s in decoding]
        for seq, proposal, limit in zip(decoding, self.proposer.propose(decoding, limits), limits):
            seq.proposal = proposal if len(proposal) else None
            if seq.proposal is None and limit:
                self._failed(seq)  # nothing to propose (no n-gram match)

    def verified(self, seq: Sequence, proposal: Proposal, accepted: int) -> None:
        """``seq`` verified ``proposal`` and kept its first ``accepted`` drafts."""
        self.counters.spec_proposed_tokens += len(proposal)
        self.counters.spec_accepted_tokens += accepted
        self.counters.spec_verifications += 1
        if accepted:
            seq.spec_failures = 0
        else:
            self._failed(seq)

    def advanced(self, seq: Sequence) -> None:
        """``seq`` has its step's tokens appended (or finished): the proposer follows."""
        if self.proposer is not None:
            (self.proposer.finished if seq.is_finished else self.proposer.verified)(seq)

    def _draft_limit(self, seq: Sequence) -> int:
        # Drafts and the token after them must fit max_tokens and the context.
        left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_seq_len - len(seq))
        return max(0, min(self.num_tokens, left - 1))

    def _may_speculate(self, seq: Sequence) -> bool:
        return seq.params.speculative and seq.spec_paused_until <= self.counters.steps

    def _failed(self, seq: Sequence) -> None:
        seq.spec_failures += 1
        pause = min(2**seq.spec_failures, self.MAX_PAUSE)
        seq.spec_paused_until = self.counters.steps + pause
