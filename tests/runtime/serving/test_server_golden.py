"""The real server on loopback, driven by the official `openai` client, against Hugging Face
transformers on SmolLM2 (fp32 artifact): concurrent greedy requests, in-flight batching, prefix
caching, a KV pool too small for everyone."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import openai
import pytest
from transformers import AutoTokenizer

from harness.serving import CHAT, PLAIN_PROMPTS, GreedyReference, ServerProcess, run_request

pytestmark = pytest.mark.slow
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def server(smollm2_fp32, tmp_path_factory):
    srv = ServerProcess(smollm2_fp32, tmp_path_factory.mktemp("smollm2-srv") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(smollm2_hf, smollm2_fp32):
    """Greedy transformers `generate` for one prompt alone, with its per-step scores."""
    hf, _ = smollm2_hf
    return GreedyReference(hf, AutoTokenizer.from_pretrained(smollm2_fp32 / "tokenizer"), NEAR_TIE)


def test_16_concurrent_requests_match_transformers(client, model_name, reference, server):
    jobs = [("chat", t, i % 2 == 0) for i, t in enumerate(CHAT)] + [
        ("plain", t, i % 2 == 1) for i, t in enumerate(PLAIN_PROMPTS)
    ]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: run_request(client, model_name, *j), jobs))
    notes = []
    for (kind, text, _), (out, reason) in zip(jobs, results):
        ids = reference.chat_ids(text) if kind == "chat" else reference.plain_ids(text)
        notes.append(reference(out, ids))
        assert reason in ("stop", "length")
    print("16 concurrent requests vs transformers:", notes)
    assert notes.count("identical") >= 12
    # They really were batched together: some step ran more than one sequence.
    m = server.metrics()
    assert m['trtc_steps_total{kind="decode"}'] > 0


def test_short_request_joins_running_batch_and_finishes_first(client, model_name, server):
    before = server.metrics().get('trtc_steps_total{kind="mixed"}', 0)
    done = {}
    long_stream = client.completions.create(
        model=model_name,
        prompt="Tell me a long story about a dragon.",
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(long_stream)
    next(it), next(it)  # the long request is decoding

    def short():
        client.completions.create(
            model=model_name, prompt="Hello there, how are", max_tokens=3, temperature=0
        )
        done["short"] = time.monotonic()

    t = threading.Thread(target=short)
    t.start()
    for _ in it:
        pass
    done["long"] = time.monotonic()
    t.join()
    assert done["short"] < done["long"], "the short request waited for the long one"
    assert server.metrics()['trtc_steps_total{kind="mixed"}'] > before


def test_shared_prefix_reuses_blocks(client, model_name, reference, server):
    prefix = reference.plain_ids(
        "The history of the printing press begins in the fifteenth century, when "
        "Johannes Gutenberg of Mainz combined movable metal type, oil-based ink and "
        "a wooden press adapted from wine making. His workshop printed the famous "
        "Bible around 1455, and the technique spread across Europe within decades, reaching "
        "Venice, Paris and London, where printers produced books, pamphlets and maps "
        "in numbers no scribe could match, "
    )[:64]
    assert len(prefix) == 64
    a = prefix + reference.plain_ids("which changed science forever. The")
    b = prefix + reference.plain_ids("so that by 1500 there were")
    hits_before = server.metrics()["trtc_prefix_cache_hits_total"]
    ra = client.completions.create(model=model_name, prompt=a, max_tokens=16, temperature=0)
    rb = client.completions.create(model=model_name, prompt=b, max_tokens=16, temperature=0)
    assert rb.usage.prompt_tokens_details.cached_tokens == 64
    assert server.metrics()["trtc_prefix_cache_hits_total"] - hits_before >= 64
    reference(ra.choices[0].text, a, 16)
    reference(rb.choices[0].text, b, 16)
    assert server.wait_idle()["trtc_kv_blocks_used"] == 0


def test_small_kv_pool_preempts_and_matches(client, model_name, smollm2_fp32, tmp_path):
    prompts = [f"Count from {i} to {i + 30}: " for i in range(8)]
    kw = dict(max_tokens=40, extra_body={"ignore_eos": True})
    with cf.ThreadPoolExecutor(8) as pool:
        unconstrained = list(
            pool.map(lambda p: run_request(client, model_name, "plain", p, False, **kw)[0], prompts)
        )
    # 14 blocks of 16 tokens: two of these requests at a time, so the rest wait or get preempted.
    small = ServerProcess(smollm2_fp32, tmp_path / "small.log", "--num-blocks", "14")
    try:
        small_client = openai.OpenAI(
            base_url=f"{small.url}/v1", api_key="unused", max_retries=0, timeout=600
        )
        with cf.ThreadPoolExecutor(8) as pool:
            constrained = list(
                pool.map(
                    lambda p: run_request(small_client, model_name, "plain", p, True, **kw)[0],
                    prompts,
                )
            )
        m = small.wait_idle()
        assert constrained == unconstrained
        assert m["trtc_preemptions_total"] > 0
        assert m["trtc_kv_blocks_used"] == 0 and m["trtc_kv_blocks_total"] == 14
    finally:
        small.stop()
