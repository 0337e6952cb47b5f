"""The replay timeline of benchmarks/decode_profile.py (``--timeline``): what each kernel adds to
a graph replay when kernels overlap, from kernel records alone (no GPU)."""

from __future__ import annotations

import pytest

from harness.benchmark_scripts import benchmark_script

decode_profile = benchmark_script("decode_profile")


def replay(at: float, last: float) -> list[tuple[str, float, float]]:
    """One replay from ``at``: a GEMM, an attention launched under it, a short kernel wholly
    inside the attention, then a norm ``last`` us long."""
    return [
        ("gemm", at, 10.0),  # ends at 10
        ("attention", at + 6, 8.0),  # started 4 before the gemm ended; adds 4
        ("combine", at + 12, 1.0),  # ends inside the attention: adds nothing
        ("norm", at + 13, last),  # started 1 before the attention ended
    ]


def test_marginal_times_sum_to_the_median_replay():
    # three replays of spans 16, 20 and 15 (listed out of order, as a trace may hold them)
    kernels = replay(200.0, 7.0)[::-1] + replay(0.0, 3.0) + replay(100.0, 2.0)
    timeline = decode_profile.replay_timeline(kernels, 3)
    assert timeline["kernels"] == 4
    assert timeline["span_us"] == 16.0  # the median replay: the one at 0
    by_kernel = {t["kernel"]: t for t in timeline["table"]}
    assert sum(t["marginal_all_us"] for t in timeline["table"]) == 16.0
    assert by_kernel["gemm"] == {
        "kernel": "gemm",
        "after": None,
        "launches": 1,
        "lead_us": 0.0,
        "duration_us": 10.0,
        "marginal_us": 10.0,
        "marginal_all_us": 10.0,
    }
    assert (by_kernel["attention"]["after"], by_kernel["attention"]["lead_us"]) == ("gemm", 4.0)
    assert by_kernel["attention"]["marginal_us"] == 4.0
    assert by_kernel["combine"]["marginal_us"] == 0.0
    assert (by_kernel["norm"]["lead_us"], by_kernel["norm"]["marginal_us"]) == (1.0, 2.0)
    assert [t["kernel"] for t in timeline["table"]] == ["gemm", "attention", "norm", "combine"]


def test_kernels_grouped_by_the_kernel_before_them():
    kernels = [("a", 0.0, 2.0), ("b", 1.0, 2.0), ("a", 3.0, 2.0), ("a", 4.0, 2.0)]
    table = decode_profile.replay_timeline(kernels, 1)["table"]
    groups = {(t["kernel"], t["after"]): t["launches"] for t in table}
    assert groups == {("a", None): 1, ("b", "a"): 1, ("a", "b"): 1, ("a", "a"): 1}


def test_a_record_count_that_is_not_whole_replays_is_refused():
    with pytest.raises(ValueError, match="7 kernels is not 2 replays"):
        decode_profile.replay_timeline(replay(0.0, 1.0) + replay(50.0, 1.0)[:3], 2)
