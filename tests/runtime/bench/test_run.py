"""`trtc bench` in-process and through a real server report the same workload the same way."""

from __future__ import annotations

import httpx
import pytest

from harness.serving import ServerProcess
from trtc.artifact import Artifact
from trtc.corpus import default_text
from trtc.runtime.bench.request_sets import make_requests
from trtc.runtime.bench.run import bench_artifact, bench_url
from trtc.runtime.engine import EngineConfig
from trtc.runtime.engine.tokenizer import load_tokenizer

SPEC = {"n": 12, "prompt_len": (8, 40), "output_len": (4, 24), "seed": 0}
TEXT_SPEC = {**SPEC, "text": default_text()}


def test_server_and_in_process_count_the_same_tokens(tiny_artifacts, tmp_path):
    """The tiny model's byte-level tokenizer decodes most ids to no text: counting streamed
    chunks with text would see a fraction of the tokens; usage and token ids see them all."""
    artifact = tiny_artifacts["tiny-llama"]
    config = EngineConfig(executor="torch", max_num_seqs=4, enable_prefix_caching=False)
    (local,) = bench_artifact(artifact, config, SPEC, 4, None, ["inflight"], log=lambda _: None)
    (local_text,) = bench_artifact(
        artifact, config, TEXT_SPEC, 4, None, ["inflight"], log=lambda _: None
    )
    tokenizer = load_tokenizer(Artifact.open(artifact).tokenizer_dir)
    server = ServerProcess(artifact, tmp_path / "server.log", "--max-num-seqs", "4")
    try:
        (http,) = bench_url(server.url, SPEC, 4, None)
        (http_text,) = bench_url(server.url, TEXT_SPEC, 4, None, tokenizer=tokenizer)
        (http_2,) = bench_url(server.url, SPEC, 4, None, processes=2)  # two load generators
        card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    finally:
        server.stop()
    # Real-text prompts: the same windows in-process and through the server.
    assert local_text["prompt_tokens"] == http_text["prompt_tokens"] != local["prompt_tokens"]
    assert local_text["output_tokens"] == http_text["output_tokens"]
    requests = make_requests(
        vocab=card["vocab_size"], reserved=set(card["special_token_ids"]), **SPEC
    )
    want = sum(r.max_tokens for r in requests)
    assert local["output_tokens"] == http["output_tokens"] == want
    # The same request set: the server's card names the special tokens left out of prompts.
    assert local["prompt_tokens"] == http["prompt_tokens"]
    # Spread over two processes, every request is sent once and every token counted.
    assert http_2["client_processes"] == 2 and http["client_processes"] == 1
    assert (http_2["requests"], http_2["prompt_tokens"], http_2["output_tokens"]) == (
        12, http["prompt_tokens"], want,
    )  # fmt: skip
    assert http_2["client_cpu_cores"] > 0 and http_2["duration_s"] > 0
    assert http["requests"] == 12 and http["tpot_s"]["p50"] > 0 and http["itl_s"]["p50"] > 0
    # Both sides' CPU is reported, read from this process and from the server's /metrics.
    assert http["client_cpu_cores"] > 0 and http["server_cpu_cores"] > 0
    assert http["engine_cpu_cores"] > 0  # the engine's own process, beside the server's
    assert http["peak_rss_mb"] > 50


def test_real_text_against_a_url_needs_the_served_tokenizer():
    """Refused before anything is sent: the prompts would be cut without the model's
    tokenizer."""
    with pytest.raises(ValueError, match="give its ARTIFACT directory too"):
        bench_url("http://127.0.0.1:9", TEXT_SPEC, 4, None)
