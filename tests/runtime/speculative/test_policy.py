"""The speculation policy on its own: when sequences get drafts, how many, and the back-off
from drafts that fail (the engine's tests check the tokens; these the rule's arithmetic)."""

from __future__ import annotations

from trtc.runtime.core.proposal import Proposal
from trtc.runtime.core.sequence import SamplingParams, Sequence
from trtc.runtime.engine.outputs import EngineCounters
from trtc.runtime.speculative.policy import SpeculationPolicy


class Fixed:
    """Proposes ``tokens`` (cut to each sequence's limit) and records the limits it was given."""

    name = "fixed"

    def __init__(self, tokens: list[int]):
        self.tokens, self.limits = tokens, []

    def propose(self, seqs, max_tokens):
        self.limits.append(list(max_tokens))
        return [Proposal(self.tokens[:k]) for k in max_tokens]


def decoding(rid: str, prompt: int = 8, outputs: int = 1, **params) -> Sequence:
    """A running sequence with ``outputs`` tokens generated and one left to compute."""
    seq = Sequence(rid, list(range(10, 10 + prompt)), SamplingParams(**params))
    for t in range(outputs):
        seq.append_token(100 + t)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def policy(proposer, max_batch=8, max_seq_len=64, num_tokens=4):
    return SpeculationPolicy(proposer, num_tokens, max_batch, max_seq_len, EngineCounters())


def test_drafts_fit_max_tokens_and_the_context():
    proposer = Fixed([1, 2, 3, 4])
    p = policy(proposer, max_seq_len=12)
    short = decoding("a", max_tokens=3, outputs=1)  # 2 tokens left: 1 draft + the next token
    near_end = decoding("b", prompt=8, outputs=1, max_tokens=100)  # 9 of 12 positions used
    roomy = decoding("c", max_tokens=100, prompt=2)
    p.propose([short, near_end, roomy])
    assert proposer.limits == [[1, 2, 4]]
    assert [len(s.proposal) for s in (short, near_end, roomy)] == [1, 2, 4]


def test_no_drafts_above_the_batch_limit_or_for_prefills_and_opted_out_requests():
    proposer = Fixed([1, 2])
    many = [decoding(str(i), max_tokens=50) for i in range(3)]
    policy(proposer, max_batch=2).propose(many)
    assert proposer.limits == [] and all(s.proposal is None for s in many)
    prefill = decoding("p", max_tokens=50)
    prefill.num_computed_tokens = 0  # its prompt is still to run
    opted_out = decoding("o", max_tokens=50, speculative=False)
    no_output = decoding("n", max_tokens=50, outputs=0)
    policy(proposer).propose([prefill, opted_out, no_output])
    assert proposer.limits == []


def test_failures_pause_a_sequence_for_a_doubling_number_of_steps():
    p = policy(Fixed([]))
    seq = decoding("a", max_tokens=500)
    pauses = []
    for _ in range(8):
        p.counters.steps = seq.spec_paused_until  # the first step it may speculate again
        start = p.counters.steps
        p.propose([seq])  # nothing proposed: a failure
        pauses.append(seq.spec_paused_until - start)
    assert pauses == [2, 4, 8, 16, 32, 64, 64, 64]
    assert not p.active([seq])  # paused now
    p.counters.steps = seq.spec_paused_until
    assert p.active([seq])


def test_verification_counts_and_an_accepted_draft_ends_the_back_off():
    p = policy(Fixed([1, 2, 3]))
    seq = decoding("a", max_tokens=100)
    p.verified(seq, Proposal([1, 2, 3]), accepted=0)
    assert seq.spec_failures == 1 and seq.spec_paused_until == 2
    p.verified(seq, Proposal([1, 2, 3]), accepted=2)
    assert seq.spec_failures == 0
    c = p.counters
    assert (c.spec_proposed_tokens, c.spec_accepted_tokens, c.spec_verifications) == (6, 2, 2)


def test_without_a_proposer_nothing_is_proposed():
    p = policy(None)
    seq = decoding("a", max_tokens=100)
    assert not p.active([seq])
    p.propose([seq])
    p.advanced(seq)
    assert seq.proposal is None
