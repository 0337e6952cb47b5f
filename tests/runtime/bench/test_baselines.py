"""The transformers baselines replay the same request set as the engine, token for token."""

from __future__ import annotations

from trtc.artifact import read_manifest
from trtc.runtime.bench.request_sets import make_requests

SPEC = {"n": 12, "prompt_len": (8, 40), "output_len": (4, 24), "seed": 0}


def test_transformers_continuous_batching_baseline_runs_the_same_set(tiny_artifacts):
    from trtc.compiler.source import load_source_model
    from trtc.contract import TORCH_DTYPES
    from trtc.runtime.bench.baselines import run_hf_continuous

    manifest = read_manifest(tiny_artifacts["tiny-llama"])
    hf = load_source_model(manifest.source, TORCH_DTYPES[manifest.precision])
    requests = make_requests(vocab=manifest.model.vocab_size, **SPEC)
    result = run_hf_continuous(hf, requests, 4, "cpu")
    assert result["mode"] == "hf-cb" and result["requests"] == 12
    # EOS ignored: every request gets exactly the tokens it asked for.
    assert result["output_tokens"] == sum(r.max_tokens for r in requests)
    assert result["prompt_tokens"] == sum(len(r.prompt_ids) for r in requests)
