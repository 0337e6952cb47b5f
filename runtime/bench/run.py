"""The two cases of `trtc bench`, one call each: an artifact loaded in-process (its modes, then
the transformers baselines), or a running server replayed through HTTP. Both cut the same
request set from the same spec."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trtc.runtime.bench.baselines import run_baselines
from trtc.runtime.bench.http_load import model_card, run_server
from trtc.runtime.bench.in_process import run_engine
from trtc.runtime.bench.request_sets import make_requests, request_set


def bench_artifact(
    artifact: str | Path,
    engine_config,
    requests_spec: dict,
    concurrency: int,
    rate: float | None,
    modes: list[str],
    hf_loader: Callable | None = None,
    log: Callable[[str], None] = print,
    baselines: tuple[str, ...] = ("hf",),
) -> list[dict]:
    """Load the artifact in-process, warm it up, replay the request set in each mode (same
    requests), and, with ``hf_loader``, transformers' static batching on the source model
    afterwards, on the same device once the engine's memory is given back (``baselines``: "hf"
    static batches, "hf-cb" transformers' continuous batching, or both). ``requests_spec``:
    `make_requests`' ``n``, ``prompt_len``, ``output_len`` and ``seed``. ``hf_loader(source,
    dtype)`` loads the manifest's source model in transformers (the compiler's loader, passed
    in by the CLI: the runtime does not import the compiler)."""
    from trtc.runtime.engine import LLMEngine

    engine = LLMEngine(artifact, engine_config)
    special = set(engine.tokenizer.all_special_ids)
    vocab = engine.manifest.model.vocab_size
    requests = request_set(requests_spec, vocab, special, engine.tokenizer)
    seed = requests_spec["seed"]
    # Warm up first: the first steps of a fresh process pay one-off allocation costs.
    warmup = make_requests(
        min(4, concurrency), requests_spec["prompt_len"], (2, 4), vocab, seed + 1, special
    )
    run_engine(engine, warmup, "inflight", concurrency)
    results = []
    for mode in modes:
        log(f"running {mode} batching: {len(requests)} requests, concurrency {concurrency} ...")
        results.append(
            run_engine(
                engine, requests, mode, concurrency, rate if mode == "inflight" else None, seed
            )
        )
    engine.close()  # a tensor-parallel engine's workers
    if hf_loader is not None:
        manifest = engine.manifest
        del engine  # give its KV pool back before the baseline loads
        results += run_baselines(manifest, requests, concurrency, hf_loader, baselines, log)
    return results


def bench_url(
    url: str,
    requests_spec: dict,
    concurrency: int,
    rate: float | None,
    api_key: str | None = None,
    tokenizer=None,
    processes: int = 1,
) -> list[dict]:
    """Replay the request set against a running `trtc serve` (a real-text set is cut with
    ``tokenizer``, the served model's, as in-process) from ``processes`` load generator
    processes (`run_server`)."""
    if "text" in requests_spec and tokenizer is None:
        raise ValueError(
            "real-text prompts (--text) against --url need the served model's tokenizer: give "
            "its ARTIFACT directory too"
        )
    model = model_card(url, api_key)
    requests = request_set(
        requests_spec,
        model.get("vocab_size", 32000),
        set(model.get("special_token_ids", ())),  # as in-process: the same request set
        tokenizer,
    )
    return [run_server(url, requests, concurrency, rate, requests_spec["seed"], api_key, processes)]
