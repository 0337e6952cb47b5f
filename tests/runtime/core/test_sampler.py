"""The sampler: greedy, temperature, top-k, top-p, seeds; and SamplingParams validation."""

from __future__ import annotations

import pytest
import torch

from trtc.runtime.core.sampler import Sampler, make_generator
from trtc.runtime.core.sequence import SamplingParams

VOCAB = 50


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` tokens drawn from one row (n copies in one batch, from torch's global generator)."""
    torch.manual_seed(seed)
    tokens = Sampler().sample(logits_row.expand(n, -1).clone(), [params] * n, [None] * n)
    return torch.tensor(tokens)


def test_greedy_is_argmax():
    logits = random_logits(8)
    tokens = Sampler().sample(logits, [SamplingParams(temperature=0)] * 8, [None] * 8)
    assert tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(temperature=2.0, top_k=1)],
)
def test_degenerate_filters_are_argmax(params):
    logits = random_logits(16, seed=1)
    for seed in range(5):
        torch.manual_seed(seed)
        assert Sampler().sample(logits, [params] * 16, [None] * 16) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = torch.zeros(1, VOCAB)  # uniform: every draw is informative

    def stream(seed):
        params = SamplingParams(seed=seed)
        g = make_generator(params)
        return [Sampler().sample(logits, [params], [g])[0] for _ in range(40)]

    assert stream(1234) == stream(1234)
    assert stream(1234) != stream(4321)
    assert len(set(stream(1234))) > 10


def test_seeded_row_does_not_depend_on_its_batch_mates():
    logits = random_logits(4, seed=3)
    params = SamplingParams(temperature=0.8, seed=7)
    alone = Sampler().sample(logits[:1], [params], [make_generator(params)])[0]
    mates = [
        params,
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=0),
    ]
    gens = [make_generator(params), None, None, None]
    torch.manual_seed(99)
    together = Sampler().sample(logits, mates, gens)
    assert together[0] == alone
    # and a longer stream, alone vs batched
    g1, g2 = make_generator(params), make_generator(params)
    a = [Sampler().sample(logits[:1], [params], [g1])[0] for _ in range(20)]
    b = [Sampler().sample(logits, mates, [g2, None, None, None])[0] for _ in range(20)]
    assert a == b


def test_temperature_matches_the_softmax_it_should():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 20_000
    freqs = {}
    for t in (0.5, 1.0, 2.0):
        tokens = draws(logits[None], SamplingParams(temperature=t), n)
        freq = torch.bincount(tokens, minlength=4).float() / n
        expected = torch.softmax(logits / t, -1)
        assert torch.allclose(freq, expected, atol=0.015), (t, freq, expected)
        freqs[t] = freq[0].item()
    assert freqs[0.5] > freqs[1.0] + 0.1 > freqs[2.0] + 0.2  # colder = sharper


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0])
    tokens = draws(logits[None], SamplingParams(top_k=2), 4000)
    assert set(tokens.tolist()) == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: tokens 0 and 1, in proportion 5:3.
    tokens = draws(logits[None], SamplingParams(top_p=0.7), 8000)
    assert set(tokens.tolist()) == {0, 1}
    assert abs((tokens == 0).float().mean().item() - 0.5 / 0.8) < 0.02
    # A set that reaches top_p exactly is enough (uniform 0.25s sum exactly).
    assert len(set(draws(torch.zeros(1, 4), SamplingParams(top_p=0.5), 4000).tolist())) == 2
    # top_p = 1 keeps even the least likely token.
    assert 3 in draws(logits[None], SamplingParams(top_p=1.0), 8000).tolist()
    # top-k first, then top-p on what it kept: top_k=3 renormalises to 0.526, 0.316, 0.158, so
    # 0.842 >= 0.82 keeps two tokens (on the raw distribution 0.8 < 0.82 would keep three).
    assert set(draws(logits[None], SamplingParams(top_k=3, top_p=0.82), 8000).tolist()) == {0, 1}


def test_logprobs_are_the_models_raw_logprobs():
    logits = random_logits(3, seed=5)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(top_k=5),
    ]
    tokens, logprobs = Sampler().sample_with_logprobs(
        logits, params, [None, make_generator(params[1]), None]
    )
    expected = torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor(tokens)]
    assert torch.allclose(torch.tensor(logprobs), expected)


def test_mismatched_batch_is_an_error():
    with pytest.raises(ValueError, match="do not match"):
        Sampler().sample(torch.zeros(2, VOCAB), [SamplingParams()], [None])


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("seed", "x"),
        ("seed", 2**64),  # beyond torch's generator seeds: refused here, not in the engine
        ("stop", ("",)),
        ("stop_token_ids", (-1,)),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}=.*must be"):
        SamplingParams(**{field: value}).validate()


def test_valid_params_and_list_coercion():
    p = SamplingParams(
        max_tokens=1, temperature=0, top_k=5, top_p=0.01, seed=3, stop=["\n\n"], stop_token_ids=[7]
    )
    assert p.validate() is p
    assert p.stop == ("\n\n",) and p.stop_token_ids == (7,)
    assert SamplingParams(stop="END").stop == ("END",)
    hash(p)  # frozen and hashable
