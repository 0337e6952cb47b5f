"""One load generator: its share of the request set replayed against a server as streamed
completions (at most ``concurrency`` in flight, or arriving on a Poisson clock), each token
timed when its chunk arrives."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

from trtc.runtime.bench.request_sets import BenchRequest
from trtc.runtime.bench.summary import RequestTiming


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


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers a server started with ``--api-key`` wants (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def timed_share(share: LoadShare) -> tuple[list[RequestTiming], float, float, float]:
    """`replay_share` of ``share``: its timings, the CPU seconds it took, its start and end."""
    start, start_cpu = time.perf_counter(), time.process_time()
    timings = asyncio.run(replay_share(share))
    return timings, time.process_time() - start_cpu, start, time.perf_counter()


async def replay_share(share: LoadShare) -> list[RequestTiming]:
    """Every request of ``share``, each a streamed completion, once its arrival time has come
    and fewer than ``share.concurrency`` of the others are in flight."""
    import httpx

    rng = random.Random(share.seed)
    sem = asyncio.Semaphore(share.concurrency)
    headers = auth_headers(share.api_key)

    async def one(client, req: BenchRequest, delay: float) -> RequestTiming:
        await asyncio.sleep(delay)
        async with sem:
            return await _stream_completion(client, share, req, headers)

    delays, clock = [], 0.0
    for _ in share.requests:
        delays.append(clock)
        if share.rate:
            clock += rng.expovariate(share.rate)
    async with httpx.AsyncClient(timeout=None) as client:
        return await asyncio.gather(*(one(client, r, d) for r, d in zip(share.requests, delays)))


async def _stream_completion(client, share: LoadShare, req: BenchRequest, headers: dict):
    """One request as a streamed /v1/completions call (greedy, EOS ignored), timed."""
    t = RequestTiming(arrival=time.perf_counter(), num_prompt_tokens=len(req.prompt_ids))
    body = {
        "model": share.model,
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
        "POST", f"{share.url}/v1/completions", json=body, headers=headers
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
                # A chunk's tokens, text or not (``return_token_ids``); from a server without
                # that extension, one per chunk with text, the rest below.
                ids = choice.get("token_ids")
                n = len(ids) if ids is not None else int(bool(choice.get("text")))
                t.token_times += [now] * n
    t.finish = time.perf_counter()
    _count_unseen_tokens(t, usage)
    return t


def _count_unseen_tokens(t: RequestTiming, usage: dict | None) -> None:
    """The tokens the stream's usage counts but its chunks did not show, timed at the end."""
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
    t.token_times += [t.finish] * missing
