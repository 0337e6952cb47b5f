"""What one run measured: each request's arrival, token times and finish, summarized into the
result every runner returns (TTFT, TPOT, inter-token and end-to-end latency as mean/p50/p90/p99,
requests/s, output tokens/s, peak memory). The same summary for every runner, so that their
results compare."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    arrival: float
    token_times: list[float] = field(default_factory=list)
    finish: float = 0.0
    num_prompt_tokens: int = 0


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
