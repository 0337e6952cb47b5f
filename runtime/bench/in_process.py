"""The engine driven in-process: in-flight batching (``concurrency`` requests kept in the
engine, or admitted on a Poisson clock) and static batching (fixed batches that wait for their
longest member, as transformers' `generate` does) on the same request set."""

from __future__ import annotations

import random
import resource
import time

from trtc.runtime.bench.request_sets import BenchRequest
from trtc.runtime.bench.summary import RequestTiming, summarize
from trtc.runtime.core.sampling_params import SamplingParams

MODES = ("inflight", "static")


def _params(req: BenchRequest, speculative: bool = True) -> SamplingParams:
    return SamplingParams(
        max_tokens=req.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        speculative=speculative,
    )


def run_engine(
    engine,
    requests: list[BenchRequest],
    mode: str,
    concurrency: int,
    rate: float | None = None,
    seed: int = 0,
    speculative: bool = True,
) -> dict:
    """In-process: ``inflight`` keeps ``concurrency`` requests in the engine (or admits them on a
    Poisson clock at ``rate``/s); ``static`` runs batches of ``concurrency`` to completion.
    ``speculative=False`` opts every request out of a speculating engine's drafts (the same
    engine then measures both sides of a comparison)."""
    rng = random.Random(seed)
    timings: dict[str, RequestTiming] = {}
    pending = list(requests)
    start = time.perf_counter()
    next_arrival = start
    peak_kv_blocks = 0
    stats = engine.stats()
    spec_before = stats.counters

    def admit(req: BenchRequest, now: float):
        rid = engine.add_request(None, _params(req, speculative), prompt_ids=req.prompt_ids)
        timings[rid] = RequestTiming(arrival=now, num_prompt_tokens=len(req.prompt_ids))

    while pending or engine.has_unfinished():
        now = time.perf_counter()
        if mode == "static":
            if not engine.has_unfinished():
                for req in pending[:concurrency]:
                    admit(req, now)
                pending = pending[concurrency:]
        elif rate:
            while pending and now >= next_arrival:
                admit(pending.pop(0), next_arrival)
                next_arrival += rng.expovariate(rate)
            if not engine.has_unfinished():
                time.sleep(max(0.0, min(next_arrival - now, 0.05)))
                continue
        else:
            in_flight = stats.num_waiting + stats.num_running  # as the last step left them
            while pending and in_flight < concurrency:
                admit(pending.pop(0), now)
                in_flight += 1
        outputs = engine.step()
        stats = engine.stats()
        peak_kv_blocks = max(peak_kv_blocks, stats.kv_blocks_used)
        now = time.perf_counter()
        for out in outputs:
            t = timings[out.request_id]
            t.token_times += [now] * len(out.new_token_ids)
            if out.finished:
                t.finish = now
    wall = time.perf_counter() - start
    result = summarize(
        mode,
        list(timings.values()),
        wall,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    result["peak_kv_mb"] = peak_kv_blocks * engine.manifest.kv_cache.bytes_per_block / 2**20
    _add_speculation(result, engine.stats().counters.since(spec_before))
    return result


def _add_speculation(result: dict, counters) -> None:
    """The run's speculative decoding counters, under ``spec``, when it verified drafts."""
    if counters.spec_verifications:
        result["spec"] = {
            "proposed_tokens": counters.spec_proposed_tokens,
            "accepted_tokens": counters.spec_accepted_tokens,
            "verifications": counters.spec_verifications,
            "mean_accepted_length": counters.mean_accepted_length,
        }
