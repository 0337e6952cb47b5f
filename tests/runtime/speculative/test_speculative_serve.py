"""Speculative decoding through the real server and the official openai client on SmolLM2
(fp32): concurrent greedy requests, some opting out of speculation, a KV pool small enough to
preempt, give exactly the text of decoding a token a step, for both proposers; /metrics counts
the drafts."""

from __future__ import annotations

import concurrent.futures as cf
import signal

import openai
import pytest

from harness.serving import PLAIN_PROMPTS, ServerProcess
from trtc.runtime.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 40
# Prompts that quote what the answer repeats, where prompt lookup finds drafts.
QUOTING = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.\n",
    "Fix the spelling in: 'Teh cat sat on teh mat and looked at teh dog.'\nCorrected:",
    "def add(a, b):\n    return a + b\n\n# The same function, with type hints:\n",
]
PROMPTS = QUOTING + PLAIN_PROMPTS[:3]


@pytest.fixture(scope="module")
def expected(smollm2_fp32):
    llm = LLM(smollm2_fp32, executor="torch")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return [o.text for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_serving_gives_the_same_greedy_text(smollm2_fp32, expected, tmp_path, proposer):
    spec = "ngram" if proposer == "ngram" else f"draft:{smollm2_fp32}"
    server = ServerProcess(
        smollm2_fp32,
        tmp_path / "server.log",
        "--speculative",
        spec,
        "--speculative-tokens",
        "4",
        "--num-blocks",
        "9",  # 6 requests of 3 blocks each do not fit at once: preemption
    )
    try:
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600
        )
        model = client.models.list().data[0].id

        def complete(i: int) -> str:
            r = client.completions.create(
                model=model,
                prompt=PROMPTS[i],
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"speculative": i % 3 != 2},  # every third one opts out
            )
            return r.choices[0].text

        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(complete, range(len(PROMPTS))))
        assert got == expected
        metrics = server.metrics()
        assert metrics["trtc_spec_verifications_total"] > 0
        assert metrics["trtc_spec_proposed_tokens_total"] > 0
        assert metrics["trtc_spec_accepted_tokens_total"] > 0
        assert metrics["trtc_spec_mean_accepted_length"] > 1
        assert metrics["trtc_preemptions_total"] > 0
    finally:
        assert server.stop() in (0, -signal.SIGTERM), server.log()
