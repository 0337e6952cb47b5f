"""What `trtc bench` prints and writes, from results of the shape the runners return."""

from __future__ import annotations

import json

from trtc.runtime.bench.report import (
    comparisons,
    json_document,
    milliseconds,
    table_rows,
    title,
)


def latencies(ms: float) -> dict:
    s = ms / 1000
    return {"mean": s, "p50": s, "p90": 2 * s, "p99": 3 * s}


def result(mode: str, tokens_per_s: float, **extra) -> dict:
    return {
        "mode": mode,
        "requests": 8,
        "duration_s": 4.0,
        "requests_per_s": 2.0,
        "prompt_tokens": 100,
        "output_tokens": int(tokens_per_s * 4),
        "output_tokens_per_s": tokens_per_s,
        "ttft_s": latencies(20.0),
        "tpot_s": latencies(0.5),
        "itl_s": {"mean": None, "p50": None, "p90": None, "p99": None},
        "e2e_s": latencies(100.0),
        "peak_rss_mb": None,
        **extra,
    }


IN_PROCESS = result(
    "inflight",
    400.0,
    peak_rss_mb=1536.4,
    peak_kv_mb=12.0,
    spec={"mean_accepted_length": 2.5},
)
SERVER = result("server", 200.0, client_cpu_cores=0.5, server_cpu_cores=1.25, client_processes=2)


def test_bench_table_keeps_sub_millisecond_latencies():
    """A single stream's TPOT is a fraction of a millisecond: the table must tell 0.591 from
    1.030 ms, not print 0.6 and 1.0."""
    assert milliseconds(0.000591) == "0.591"
    assert milliseconds(0.00103) == "1.030"
    assert milliseconds(0.1547) == "154.7"
    assert milliseconds(None) == "-"


def test_table_rows_have_a_metric_and_a_cell_per_result():
    rows = {row[0]: row[1:] for row in table_rows([IN_PROCESS, SERVER])}
    assert list(rows) == [
        "requests/s",
        "output tokens/s",
        *[f"{m} ms {p}" for m in ("TTFT", "TPOT", "ITL", "E2E") for p in ("p50", "p90", "p99")],
        "duration s",
        "peak KV MB",
        "peak RSS MB",
        "CPU cores client / server / engine",
        "client processes",
        "tokens per verifying step",
    ]
    assert rows["requests/s"] == ["2.00", "2.00"]
    assert rows["output tokens/s"] == ["400.0", "200.0"]
    assert rows["TTFT ms p50"] == ["20.0", "20.0"] and rows["TPOT ms p99"] == ["1.500"] * 2
    assert rows["ITL ms p90"] == ["-", "-"]
    assert rows["duration s"] == ["4.0", "4.0"]
    assert rows["peak KV MB"] == ["12.0", "-"] and rows["peak RSS MB"] == ["1536", "-"]
    assert rows["CPU cores client / server / engine"] == ["- / - / -", "0.50 / 1.25 / -"]
    assert rows["client processes"] == ["-", "2"]
    assert rows["tokens per verifying step"] == ["2.50", "-"]


def test_server_and_speculation_rows_only_where_a_result_has_them():
    labels = [row[0] for row in table_rows([result("inflight", 1.0), result("static", 1.0)])]
    assert labels[-3:] == ["duration s", "peak KV MB", "peak RSS MB"]


def test_title_comparisons_and_json_document():
    assert title(64, "32:256", "16:128", 0, None) == (
        "trtc bench: 64 requests, prompts 32:256, outputs 16:128, seed 0"
    )
    assert title(8, "8", "4:8", 3, "pydoc") == (
        "trtc bench: 8 requests, prompts 8 (text: pydoc), outputs 4:8, seed 3"
    )
    assert comparisons([IN_PROCESS]) == []
    assert comparisons([IN_PROCESS, SERVER]) == [
        "inflight / server: 2.00x output tokens/s, 1.00x mean E2E latency, 1.00x TTFT p50"
    ]
    document = json_document([IN_PROCESS, SERVER], 64, "32:256", "16:128", 0, 16)
    assert list(document) == [
        "requests",
        "prompt_len",
        "output_len",
        "seed",
        "concurrency",
        "results",
    ]
    assert (document["requests"], document["prompt_len"], document["concurrency"]) == (
        64, "32:256", 16,
    )  # fmt: skip
    assert json.loads(json.dumps(document))["results"] == [IN_PROCESS, SERVER]
