"""The transformers baselines on the same request set, on the device the engine used:
`generate` in static batches, and transformers' own continuous batching. Only the tokens each
request asked for count as output, so their results compare with the engine's."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from trtc.artifact import Manifest
from trtc.runtime.bench.request_sets import BenchRequest
from trtc.runtime.bench.summary import RequestTiming, summarize


def run_baselines(
    manifest: Manifest,
    requests: list[BenchRequest],
    concurrency: int,
    hf_loader: Callable,
    baselines: tuple[str, ...],
    log: Callable[[str], None],
) -> list[dict]:
    """Load the manifest's source model with ``hf_loader(source, dtype)`` and run the named
    ``baselines`` ("hf": static batches of ``concurrency``, "hf-cb": continuous batching with
    at most ``concurrency`` in flight). The engine's memory must be given back first: its
    caller drops the engine, this collects it."""
    import torch

    from trtc.contract import TORCH_DTYPES

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    hf = hf_loader(manifest.source, TORCH_DTYPES[manifest.precision]).to(device)
    results = []
    if "hf" in baselines:
        log(f"running transformers generate, static batches of {concurrency} ({device}) ...")
        results.append(run_hf_static(hf, requests, concurrency, device))
    if "hf-cb" in baselines:
        log(f"running transformers continuous batching, {concurrency} in flight ({device}) ...")
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        results.append(run_hf_continuous(hf, requests, concurrency, device))
    return results


def run_hf_static(hf_model, requests: list[BenchRequest], batch_size: int, device: str) -> dict:
    """The baseline: transformers' `generate` on the same requests in fixed batches (left-padded,
    greedy, EOS ignored); a batch runs until its longest member is done. Only the tokens each
    request asked for count as output."""
    import torch

    timings = []
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids) :] = 1
        longest = max(r.max_tokens for r in batch)
        arrival = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        done = time.perf_counter()
        for r in batch:
            # No per-token times from generate: tokens are spread evenly over the batch's time.
            step = (done - arrival) / longest
            timings.append(
                RequestTiming(
                    arrival,
                    [arrival + step * (k + 1) for k in range(r.max_tokens)],
                    done,
                    len(r.prompt_ids),
                )
            )
    wall = time.perf_counter() - start
    return _with_peak_gpu(summarize("hf-static", timings, wall, None), device)


def run_hf_continuous(
    hf_model, requests: list[BenchRequest], concurrency: int, device: str
) -> dict:
    """The stronger baseline: transformers' own continuous batching (`ContinuousBatchingManager`,
    paged attention, CUDA graphs where transformers decides to use them), at most
    ``concurrency`` requests in flight, greedy, EOS ignored. Each token is timed when its
    streamed partial result is read."""
    from transformers import GenerationConfig

    longest = max(r.max_tokens for r in requests)
    config = GenerationConfig(
        max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    manager = hf_model.init_continuous_batching(generation_config=config)
    manager.start()
    # Its first request pays the manager's set-up (cache allocation, graph capture): untimed.
    manager.add_request(requests[0].prompt_ids, "warmup", max_new_tokens=2, eos_token_id=-1)
    while (out := manager.get_result(timeout=600)) is None or not out.is_finished():
        if out is None:
            raise RuntimeError("transformers' continuous batching did not answer its warm-up")
    timings: dict[str, RequestTiming] = {}
    pending = list(enumerate(requests))
    in_flight = done = 0
    start = time.perf_counter()
    try:
        while done < len(requests):
            while pending and in_flight < concurrency:
                i, req = pending.pop(0)
                rid = f"bench-{i}"
                timings[rid] = RequestTiming(
                    time.perf_counter(), num_prompt_tokens=len(req.prompt_ids)
                )
                manager.add_request(
                    req.prompt_ids,
                    request_id=rid,
                    max_new_tokens=req.max_tokens,
                    streaming=True,
                    eos_token_id=-1,
                )
                in_flight += 1
            result = manager.get_result(timeout=1.0)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped early")
                continue
            if result.error:
                raise RuntimeError(f"transformers' continuous batching failed: {result.error}")
            now = time.perf_counter()
            t = timings[result.request_id]
            t.token_times += [now] * (len(result.generated_tokens) - len(t.token_times))
            if result.is_finished():
                t.finish = now
                in_flight, done = in_flight - 1, done + 1
    finally:
        manager.stop(block=True)
    wall = time.perf_counter() - start
    return _with_peak_gpu(summarize("hf-cb", list(timings.values()), wall, None), device)


def _with_peak_gpu(result: dict, device: str) -> dict:
    """``result`` with the peak GPU memory torch allocated, on a CUDA device."""
    if device.startswith("cuda"):
        import torch

        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result
