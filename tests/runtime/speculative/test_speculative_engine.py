"""Speculative decoding in the engine: greedy output identical to decoding a token a step, for
both proposers, with requests that opt out beside ones that speculate and preemption forced by
a small pool; rejected drafts give their slots back; the speculation off-rule."""

from __future__ import annotations

import pytest

from trtc.compiler.config import parse_config
from trtc.runtime.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=48, temperature=0)
# Repetitive prompts, where prompt lookup finds drafts, and a plain one.
PROMPTS = [list(range(30, 60)) * 3, [5, 6, 7, 8] * 10, list(range(100, 112)), [70, 71] * 12]


@pytest.fixture(scope="module")
def poor_draft(tmp_path_factory):
    """tiny-llama with other random weights: the same (byte) tokenizer, different guesses."""
    from conftest import build_quiet

    cfg = parse_config(
        {
            "model": {"source": "tiny", "name": "tiny-llama", "seed": 1},
            "precision": "fp32",
            "limits": {"max_num_tokens": 256, "max_num_seqs": 8},
        }
    )
    return build_quiet(cfg, tmp_path_factory.mktemp("draft") / "tiny-llama-seed1")


def _run(artifact, num_blocks: int, **spec) -> tuple[list[list[int]], LLM]:
    llm = LLM(artifact, executor="torch", num_blocks=num_blocks, **spec)
    params = [GREEDY, GREEDY, SamplingParams(max_tokens=48, temperature=0, speculative=False)]
    params.append(GREEDY)
    return [o.token_ids for o in llm.generate(PROMPTS, params)], llm


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
@pytest.mark.parametrize("proposer", ["ngram", "draft-self", "draft-poor"])
def test_greedy_output_is_unchanged(tiny_artifacts, poor_draft, name, proposer):
    artifact = tiny_artifacts[name]
    spec = {
        "ngram": "ngram",
        "draft-self": f"draft:{artifact}",
        "draft-poor": f"draft:{poor_draft}",
    }[proposer]
    expect, _ = _run(artifact, 64)
    # 14 blocks of 16 tokens cannot hold the four sequences at once: some are preempted.
    got, llm = _run(artifact, 14, speculative=spec, speculative_tokens=4)
    assert got == expect
    engine = llm.engine
    counters = engine.counters
    assert counters.spec_verifications > 0 and counters.spec_proposed_tokens > 0
    assert engine.scheduler.num_preemptions > 0
    if proposer == "draft-self":  # the target drafting for itself: every draft passes
        assert counters.spec_accepted_tokens == counters.spec_proposed_tokens
    if proposer == "draft-poor":
        assert counters.spec_accepted_tokens < counters.spec_proposed_tokens
    assert counters.steps < sum(len(t) for t in got)  # fewer steps than tokens
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_speculation_stops_above_the_batch_limit(tiny_artifacts):
    llm = LLM(
        tiny_artifacts["tiny-llama"],
        executor="torch",
        num_blocks=64,
        speculative="ngram",
        speculative_max_batch=3,
    )
    llm.generate(PROMPTS, GREEDY)  # four at once: no speculation until one finishes
    first_steps = llm.engine.counters.spec_verifications
    assert first_steps < llm.engine.counters.steps
    alone = LLM(
        tiny_artifacts["tiny-llama"], executor="torch", speculative="ngram", speculative_max_batch=0
    )
    alone.generate(PROMPTS[:1], GREEDY)
    assert alone.engine.counters.spec_verifications == 0


def test_speculation_backs_off_from_drafts_that_keep_failing(tiny_artifacts):
    """A proposer whose drafts are always wrong: verifications thin out (a pause that doubles
    with each failure), and the output is still a token a step's."""
    from trtc.runtime.core.proposal import Proposal

    class Wrong:
        name = "wrong"

        def propose(self, seqs, max_tokens):
            # The vocabulary's last id, which the tiny model never picks after these prompts.
            return [Proposal([259] * k) for k in max_tokens]

        def verified(self, seq):
            pass

        def finished(self, seq):
            pass

    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    expect = LLM(tiny_artifacts["tiny-llama"], executor="torch").generate(PROMPTS[:1], params)
    llm = LLM(tiny_artifacts["tiny-llama"], executor="torch", speculative="ngram")
    llm.engine.speculation.proposer = Wrong()
    got = llm.generate(PROMPTS[:1], params)
    assert got[0].token_ids == expect[0].token_ids
    c = llm.engine.counters
    assert c.spec_accepted_tokens == 0
    # Failures after 2, 4, 8, 16, 32 and 64 steps: 7 verifications in 96 tokens, not 95.
    assert 3 <= c.spec_verifications <= 8


def test_sampled_requests_are_reproducible_with_a_seed(tiny_artifacts, poor_draft):
    params = SamplingParams(max_tokens=32, temperature=0.9, seed=3)
    runs = []
    for _ in range(2):
        llm = LLM(tiny_artifacts["tiny-llama"], executor="torch", speculative=f"draft:{poor_draft}")
        runs.append(llm.generate(PROMPTS[:2], params))
        assert llm.engine.counters.spec_verifications > 0
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]


def test_a_draft_with_another_tokenizer_is_refused(tiny_artifacts, smollm2_fp32):
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        LLM(tiny_artifacts["tiny-llama"], executor="torch", speculative=f"draft:{smollm2_fp32}")


@pytest.mark.gpu
@pytest.mark.parametrize("proposer", ["ngram", "draft-poor"])
def test_greedy_output_is_unchanged_on_the_cuda_executor(tiny_artifacts, poor_draft, proposer):
    artifact = tiny_artifacts["tiny-llama"]
    spec = "ngram" if proposer == "ngram" else f"draft:{poor_draft}"
    plain = LLM(artifact, executor="cuda", num_blocks=64)
    expect = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    fast = LLM(artifact, executor="cuda", num_blocks=64, speculative=spec)
    assert [o.token_ids for o in fast.generate(PROMPTS, GREEDY)] == expect
    assert fast.engine.counters.spec_verifications > 0
