"""A run's request timings summarized: latency percentiles, throughput and memory."""

from __future__ import annotations

import pytest

from trtc.runtime.bench.summary import RequestTiming, percentiles, summarize


def test_percentiles_interpolate_between_ranks():
    p = percentiles([4.0, 1.0, 3.0, 2.0])
    assert p["mean"] == 2.5 and p["p50"] == 2.5
    assert p["p90"] == pytest.approx(3.7) and p["p99"] == pytest.approx(3.97)
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_summary_of_request_timings():
    timings = [
        RequestTiming(arrival=0.0, token_times=[0.1, 0.2, 0.4], finish=0.5, num_prompt_tokens=7),
        RequestTiming(arrival=1.0, token_times=[1.3], finish=1.3, num_prompt_tokens=5),
    ]
    r = summarize("inflight", timings, 2.0, 3 * 2**20)
    assert (r["mode"], r["requests"], r["prompt_tokens"], r["output_tokens"]) == (
        "inflight", 2, 12, 4,
    )  # fmt: skip
    assert r["requests_per_s"] == 1.0 and r["output_tokens_per_s"] == 2.0
    assert r["ttft_s"]["p50"] == pytest.approx(0.2)  # 0.1 and 0.3
    assert r["tpot_s"]["mean"] == pytest.approx(0.15)  # a one-token request has none
    assert r["itl_s"]["mean"] == pytest.approx(0.15)  # 0.1 and 0.2
    assert r["e2e_s"]["mean"] == pytest.approx(0.4)  # 0.5 and 0.3
    assert r["peak_rss_mb"] == 3.0
    assert summarize("server", timings, 2.0, None)["peak_rss_mb"] is None
