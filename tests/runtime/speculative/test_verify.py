"""Verification keeps the target's distribution: greedy output is the argmax chain; sampled
output passes a chi-square test against the target's distribution with a deliberately poor
draft, and the same test catches a broken acceptance rule."""

from __future__ import annotations

import pytest
import torch

from trtc.contract import SequenceWork, make_step
from trtc.runtime.core.proposal import Proposal
from trtc.runtime.core.sampler import Sampler
from trtc.runtime.core.sequence import SamplingParams
from trtc.runtime.speculative import verify as verify_module
from trtc.runtime.speculative.verify import verify

GREEDY = SamplingParams(temperature=0)


def one_hot_logits(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


@pytest.mark.parametrize(
    "target,drafts,emitted",
    [
        ([3, 4, 5, 6], [3, 4, 5], [3, 4, 5, 6]),  # all accepted, and the free token after
        ([3, 4, 5, 6], [3, 9, 5], [3, 4]),  # the first mismatch is replaced, the rest dropped
        ([3, 4, 5, 6], [7, 4, 5], [3]),
        ([3], [], [3]),
    ],
)
def test_greedy_accepts_the_longest_prefix_of_argmaxes(target, drafts, emitted):
    assert verify(one_hot_logits(target), Proposal(drafts), GREEDY) == emitted


def test_rows_must_match_the_drafts():
    with pytest.raises(ValueError, match="3 logits rows to verify 1 drafts"):
        verify(one_hot_logits([1, 2, 3]), Proposal([1]), GREEDY)


def target_logits(tiny_artifacts) -> torch.Tensor:
    """A tiny model's next-token logits after a prompt, and after two more tokens."""
    from trtc.runtime.executors import create_executor

    executor = create_executor(
        "torch", __import__("trtc.artifact").artifact.Artifact.open(tiny_artifacts["tiny-llama"]), 8
    )
    step = make_step([SequenceWork([65, 66, 67, 68, 69, 70], 0, [0], num_logits=3)], 16)
    return executor.execute(step)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probs``, bins of expected count < 5 pooled."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2))


def first_tokens(logits, params, proposer: str, trials: int) -> torch.Tensor:
    """Counts of the first token verification emits over ``trials`` seeded rounds, the drafts
    drawn from a poor proposer: ``q`` the reverse of the target's ranking on its support (most
    of its mass where the target has least), or a deterministic one (a point mass on the
    target's least likely token)."""
    vocab = logits.shape[-1]
    p = Sampler._probs([params] * 3, logits.float())
    counts = torch.zeros(vocab)
    generator = torch.Generator().manual_seed(0)
    if proposer == "sampled":
        q = torch.where(p > 0, 1 / p, torch.zeros_like(p))
        q = q / q.sum(dim=-1, keepdim=True)
    for _ in range(trials):
        if proposer == "sampled":
            drafts = [int(torch.multinomial(q[i], 1, generator=generator)) for i in range(2)]
            proposal = Proposal(drafts, q[:2])
        else:
            least = int(p[0].masked_fill(p[0] == 0, 2.0).argmin())
            proposal = Proposal([least, least])
        counts[verify(logits, proposal, params, generator)[0]] += 1
    return counts, p[0]


def _always(p_token, q_token):
    return torch.ones(())


def _without_q(p, q):
    return p


@pytest.mark.parametrize("proposer", ["sampled", "deterministic"])
@pytest.mark.parametrize(
    "broken",
    [
        None,
        pytest.param(("acceptance_probability", _always), id="accept-every-draft"),
        pytest.param(("residual", _without_q), id="resample-from-p-not-p-minus-q"),
    ],
)
def test_sampled_output_follows_the_target_distribution(
    tiny_artifacts, monkeypatch, proposer, broken
):
    """The test's power is part of the test: with the rule broken it must reject."""
    logits = target_logits(tiny_artifacts)
    params = SamplingParams(temperature=0.8, top_k=12)
    if broken is not None:
        monkeypatch.setattr(verify_module, *broken)
    counts, p = first_tokens(logits, params, proposer, trials=3000)
    p_value = chi_square_p_value(counts, p)
    if broken is None:
        assert p_value > 1e-3, (p_value, counts[p > 0], p[p > 0] * counts.sum())
    else:
        assert p_value < 1e-6, p_value


def test_a_seeded_request_verifies_the_same_way_twice(tiny_artifacts):
    logits = target_logits(tiny_artifacts)
    params = SamplingParams(temperature=1.0, seed=7)
    q = torch.softmax(torch.zeros(2, logits.shape[-1]), dim=-1)
    runs = [
        verify(logits, Proposal([1, 2], q), params, torch.Generator().manual_seed(7))
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
