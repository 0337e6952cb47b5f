"""`trtc bench` in-process and through a real server report the same workload the same way."""

from __future__ import annotations

import httpx

from harness.serving import ServerProcess
from trtc.runtime.bench import bench_artifact, bench_url, make_requests
from trtc.runtime.engine import EngineConfig

SPEC = {"n": 12, "prompt_len": (8, 40), "output_len": (4, 24), "seed": 0}


def test_server_and_in_process_count_the_same_tokens(tiny_artifacts, tmp_path):
    """The tiny model's byte-level tokenizer decodes most ids to no text: counting streamed
    chunks with text would see a fraction of the tokens; usage and token ids see them all."""
    artifact = tiny_artifacts["tiny-llama"]
    config = EngineConfig(executor="torch", max_num_seqs=4, enable_prefix_caching=False)
    (local,) = bench_artifact(artifact, config, SPEC, 4, None, ["inflight"], log=lambda _: None)
    server = ServerProcess(artifact, tmp_path / "server.log", "--max-num-seqs", "4")
    try:
        (http,) = bench_url(server.url, SPEC, 4, None)
        card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    finally:
        server.stop()
    requests = make_requests(
        vocab=card["vocab_size"], reserved=set(card["special_token_ids"]), **SPEC
    )
    want = sum(r.max_tokens for r in requests)
    assert local["output_tokens"] == http["output_tokens"] == want
    # The same request set: the server's card names the special tokens left out of prompts.
    assert local["prompt_tokens"] == http["prompt_tokens"]
    assert http["requests"] == 12 and http["tpot_s"]["p50"] > 0 and http["itl_s"]["p50"] > 0


def test_transformers_continuous_batching_baseline_runs_the_same_set(tiny_artifacts):
    from trtc.artifact import read_manifest
    from trtc.compiler.source import load_source_model
    from trtc.contract import TORCH_DTYPES
    from trtc.runtime.bench import run_hf_continuous

    manifest = read_manifest(tiny_artifacts["tiny-llama"])
    hf = load_source_model(manifest.source, TORCH_DTYPES[manifest.precision])
    requests = make_requests(vocab=manifest.model.vocab_size, **SPEC)
    result = run_hf_continuous(hf, requests, 4, "cpu")
    assert result["mode"] == "hf-cb" and result["requests"] == 12
    # EOS ignored: every request gets exactly the tokens it asked for.
    assert result["output_tokens"] == sum(r.max_tokens for r in requests)
    assert result["prompt_tokens"] == sum(len(r.prompt_ids) for r in requests)
