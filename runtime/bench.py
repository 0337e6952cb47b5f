"""`trtc bench`: replay a request set against the Python API or a running server and report the
numbers of inference: TTFT, TPOT, inter-token latency, end-to-end latency (p50/p90/p99),
requests/s, output tokens/s and peak memory; in-flight batching and static batching (fixed
batches that wait for their longest member, as transformers' `generate` does) on the same set."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trtc.artifact import Manifest
from trtc.runtime.core.sampling_params import SamplingParams
from trtc.runtime.engine.process_exit import exit_reason

MODES = ("inflight", "static")


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class RequestTiming:
    arrival: float
    token_times: list[float] = field(default_factory=list)
    finish: float = 0.0
    num_prompt_tokens: int = 0


def make_requests(
    n: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab: int,
    seed: int,
    reserved: set[int] = frozenset(),
) -> list[BenchRequest]:
    """A reproducible request set: random token prompts (no special tokens), fixed output
    lengths."""
    rng = random.Random(seed)
    usable = [t for t in range(min(vocab, 32000)) if t not in reserved]
    return [
        BenchRequest(
            [rng.choice(usable) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len)
        )
        for _ in range(n)
    ]


def text_requests(
    token_ids: list[int],
    n: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> list[BenchRequest]:
    """A reproducible request set of real text: each prompt a window of ``token_ids`` (a text
    tokenized by the model's tokenizer) at a seeded offset, its length drawn from
    ``prompt_len``; fixed output lengths."""
    if len(token_ids) < prompt_len[1]:
        raise ValueError(
            f"the text is {len(token_ids)} tokens long: too short for prompts of up to "
            f"{prompt_len[1]} tokens (--prompt-len)"
        )
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        length = rng.randint(*prompt_len)
        start = rng.randrange(len(token_ids) - length + 1)
        requests.append(BenchRequest(token_ids[start : start + length], rng.randint(*output_len)))
    return requests


def request_set(spec: dict, vocab: int, reserved: set[int], tokenizer=None) -> list[BenchRequest]:
    """The requests of ``spec`` (`make_requests`' ``n``, ``prompt_len``, ``output_len``,
    ``seed``, and optionally ``text``: a text to cut the prompts from with ``tokenizer``,
    instead of random tokens)."""
    spec = dict(spec)
    text = spec.pop("text", None)
    if text is None:
        return make_requests(vocab=vocab, reserved=reserved, **spec)
    # verbose=False: the whole text is longer than the model's context, which is no error here
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return text_requests(list(ids), **spec)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(p):
        k = (len(ordered) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(name: str, timings: list[RequestTiming], wall: float, peak_rss: int | None) -> dict:
    ttft = [t.token_times[0] - t.arrival for t in timings if t.token_times]
    tpot = [
        (t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1)
        for t in timings
        if len(t.token_times) > 1
    ]
    itl = [b - a for t in timings for a, b in zip(t.token_times, t.token_times[1:])]
    e2e = [t.finish - t.arrival for t in timings]
    out_tokens = sum(len(t.token_times) for t in timings)
    return {
        "mode": name,
        "requests": len(timings),
        "duration_s": wall,
        "requests_per_s": len(timings) / wall,
        "prompt_tokens": sum(t.num_prompt_tokens for t in timings),
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles(e2e),
        "peak_rss_mb": peak_rss / 2**20 if peak_rss else None,
    }


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
    c = engine.stats().counters.since(spec_before)
    if c.spec_verifications:
        result["spec"] = {
            "proposed_tokens": c.spec_proposed_tokens,
            "accepted_tokens": c.spec_accepted_tokens,
            "verifications": c.spec_verifications,
            "mean_accepted_length": c.mean_accepted_length,
        }
    return result


@dataclass
class LoadShare:
    """What one load generator replays against the server at ``url``: its requests, at most
    ``concurrency`` in flight (or arriving on a Poisson clock at ``rate``/s, seeded)."""

    url: str
    model: str
    requests: list[BenchRequest]
    concurrency: int
    rate: float | None
    seed: int
    api_key: str | None


async def _run_server(share: LoadShare) -> list[RequestTiming]:
    import httpx

    url, model, rate = share.url, share.model, share.rate
    rng = random.Random(share.seed)
    sem = asyncio.Semaphore(share.concurrency)
    headers = {"Authorization": f"Bearer {share.api_key}"} if share.api_key else {}

    async def one(client, req: BenchRequest, delay: float) -> RequestTiming:
        await asyncio.sleep(delay)
        async with sem:
            t = RequestTiming(arrival=time.perf_counter(), num_prompt_tokens=len(req.prompt_ids))
            body = {
                "model": model,
                "prompt": req.prompt_ids,
                "max_tokens": req.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                "return_token_ids": True,
            }
            usage = None
            async with client.stream(
                "POST", f"{url}/v1/completions", json=body, headers=headers
            ) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"server answered {r.status_code}: {await r.aread()!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    now = time.perf_counter()
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        # A chunk's tokens, text or not (``return_token_ids``); from a server
                        # without that extension, one per chunk with text, the rest below.
                        ids = choice.get("token_ids")
                        n = len(ids) if ids is not None else int(bool(choice.get("text")))
                        t.token_times += [now] * n
            t.finish = time.perf_counter()
            if usage is None:
                raise RuntimeError(
                    "the server's stream ended without a usage chunk "
                    "(stream_options.include_usage is not supported there)"
                )
            missing = usage["completion_tokens"] - len(t.token_times)
            if missing < 0:
                raise RuntimeError(
                    f"the stream carried {len(t.token_times)} tokens but its usage says "
                    f"{usage['completion_tokens']}"
                )
            t.token_times += [t.finish] * missing  # counted by usage, not seen in the chunks
            return t

    delays, clock = [], 0.0
    for _ in share.requests:
        delays.append(clock)
        if rate:
            clock += rng.expovariate(rate)
    async with httpx.AsyncClient(timeout=None) as client:
        return await asyncio.gather(*(one(client, r, d) for r, d in zip(share.requests, delays)))


def default_load_processes(concurrency: int) -> int:
    """Processes the load generator spreads its streams over by default: one per 16 streams,
    at most 4, and at most half the CPUs (the server and its engine need theirs)."""
    return max(1, min(4, concurrency // 16, (os.cpu_count() or 2) // 2))


def run_server(
    url: str,
    requests: list[BenchRequest],
    concurrency: int,
    rate: float | None = None,
    seed: int = 0,
    api_key: str | None = None,
    processes: int = 1,
) -> dict:
    """Replay ``requests`` against the server at ``url``. With ``processes`` > 1 the load
    generator is that many processes, each with every ``processes``-th request, its share of
    the concurrency (and of the rate), started together: one Python process parsing 64
    streams of SSE chunks at ~20k tokens/s is itself near a core, and a client that falls
    behind delays the next request of each stream, which shows as the server's throughput."""
    import httpx

    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
    processes = max(1, min(processes, concurrency, len(requests)))
    # Every processes-th request, its part of the streams and of the rate, for each process.
    shares = [
        LoadShare(
            url,
            model,
            requests[k::processes],
            concurrency // processes + (k < concurrency % processes),
            rate / processes if rate else None,
            seed + k,
            api_key,
        )
        for k in range(processes)
    ]
    before = _server_metrics(url)
    if processes == 1:
        timings, client_cpu, start, end = _timed_share(shares[0])
        wall = end - start
    else:
        timings, wall, client_cpu = _run_server_processes(shares)
    after = _server_metrics(url)
    # Resident memory of the server and of its engine process (when it has one).
    rss = after.get("process_resident_memory_bytes", 0)
    rss += after.get("engine_process_resident_memory_bytes", 0)
    result = summarize("server", timings, wall, rss or None)
    # Cores each side kept busy: a load generator near one core bounds what it can measure,
    # and a server process near one core is bound by its interpreter, not by its GPU.
    result["client_cpu_cores"] = client_cpu / wall
    result["client_processes"] = processes
    for side, prefix in (("server", ""), ("engine", "engine_")):
        name = f"{prefix}process_cpu_seconds_total"
        if name in before and name in after:
            result[f"{side}_cpu_cores"] = (after[name] - before[name]) / wall
    return result


def _run_server_processes(shares: list[LoadShare]) -> tuple[list[RequestTiming], float, float]:
    """`_run_server` in a process per share, started together: the timings of all, the wall
    time from their common start to the last one's end, and the CPU seconds they used."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # (a forked child would inherit this process's threads)
    go, messages = ctx.Event(), ctx.Queue()
    workers = [
        ctx.Process(
            target=_server_share,
            args=(share, go, messages),
            name=f"trtc-bench-client-{k}",
            daemon=True,
        )
        for k, share in enumerate(shares)
    ]
    for w in workers:
        w.start()
    try:
        for _ in workers:  # each has imported what it needs
            _next_message(messages, workers)
        go.set()
        start = time.perf_counter()
        timings, cpu, end = [], 0.0, start
        for _ in workers:
            got, share_cpu, share_end = _next_message(messages, workers)
            if isinstance(got, str):  # its error
                raise RuntimeError(f"a load generator process failed: {got}")
            timings += got
            cpu += share_cpu
            end = max(end, share_end)
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
            w.join(timeout=10)
    return timings, end - start, cpu


def _next_message(messages, workers):
    """The next message of the load generator processes; an error if one of them died."""
    import queue

    while True:
        try:
            return messages.get(timeout=1.0)
        except queue.Empty:
            dead = next((w for w in workers if w.exitcode not in (None, 0)), None)
            if dead is not None:
                raise RuntimeError(
                    f"load generator process {dead.name} died ({exit_reason(dead.exitcode)}); "
                    "its error is above"
                ) from None


def _server_share(share: LoadShare, go, messages) -> None:
    """One load generator process (`_run_server_processes`): says it is ready, waits for the
    others, runs its share, and puts (timings, CPU seconds, end time), or the error as text."""
    import httpx  # noqa: F401  (imported before the start, not in the timed part)

    messages.put("ready")
    go.wait()
    try:
        timings, cpu, _, end = _timed_share(share)
    except Exception as e:  # (sent as text: not every exception pickles)
        messages.put((f"{type(e).__name__}: {e}", 0.0, time.perf_counter()))
        return
    messages.put((timings, cpu, end))


def _timed_share(share: LoadShare) -> tuple[list[RequestTiming], float, float, float]:
    """`_run_server` of ``share``: its timings, the CPU seconds it took, its start and end."""
    start, start_cpu = time.perf_counter(), time.process_time()
    timings = asyncio.run(_run_server(share))
    return timings, time.process_time() - start_cpu, start, time.perf_counter()


def _server_metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of the server's /metrics."""
    import httpx

    samples = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            samples[name] = float(value)
    return samples


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
    result = summarize("hf-static", timings, wall, None)
    if device.startswith("cuda"):
        import torch

        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def run_hf_continuous(
    hf_model, requests: list[BenchRequest], concurrency: int, device: str
) -> dict:
    """The stronger baseline: transformers' own continuous batching (`ContinuousBatchingManager`,
    paged attention, CUDA graphs where transformers decides to use them), at most
    ``concurrency`` requests in flight, greedy, EOS ignored. Each token is timed when its
    streamed partial result is read."""
    import torch
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
    result = summarize("hf-cb", list(timings.values()), wall, None)
    if device.startswith("cuda"):
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


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
    import torch

    from trtc.contract import TORCH_DTYPES
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
        manifest: Manifest = engine.manifest
        device = "cuda" if torch.cuda.is_available() else "cpu"
        del engine  # give its KV pool back before the baseline loads
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        hf = hf_loader(manifest.source, TORCH_DTYPES[manifest.precision]).to(device)
        if "hf" in baselines:
            log(f"running transformers generate, static batches of {concurrency} ({device}) ...")
            results.append(run_hf_static(hf, requests, concurrency, device))
        if "hf-cb" in baselines:
            log(f"running transformers continuous batching, {concurrency} in flight ({device}) ...")
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            results.append(run_hf_continuous(hf, requests, concurrency, device))
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
    import httpx

    if "text" in requests_spec and tokenizer is None:
        raise ValueError(
            "real-text prompts (--text) against --url need the served model's tokenizer: give "
            "its ARTIFACT directory too"
        )
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers).json()["data"][0]
    requests = request_set(
        requests_spec,
        model.get("vocab_size", 32000),
        set(model.get("special_token_ids", ())),  # as in-process: the same request set
        tokenizer,
    )
    return [run_server(url, requests, concurrency, rate, requests_spec["seed"], api_key, processes)]


def comparisons(results: list[dict]) -> list[str]:
    """The first result against each other one, in words."""
    first = results[0]
    return [
        f"{first['mode']} / {other['mode']}: "
        f"{first['output_tokens_per_s'] / other['output_tokens_per_s']:.2f}x output tokens/s, "
        f"{first['e2e_s']['mean'] / other['e2e_s']['mean']:.2f}x mean E2E latency, "
        f"{first['ttft_s']['p50'] / other['ttft_s']['p50']:.2f}x TTFT p50"
        for other in results[1:]
    ]
