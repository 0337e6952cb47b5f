"""The measurements of `headline.py`, one step each, each running one command of this repository
and reading the JSON it writes:

- the device's copy bandwidth: `timing.copy_bandwidth` (4 GiB);
- the mixed workload (`trtc bench ARTIFACT -n 256 --prompt-len 128:1024 --output-len 32:512
  --concurrency 64 --mode inflight`) in-process, through `trtc serve` (``trtc bench --url``
  against a server started and stopped here; ready when ``/health`` answers), and beside
  transformers' static batches (``--baseline hf``) and continuous batching (``--baseline
  hf-cb``), which load the artifact's source model: output tokens/s, TTFT and TPOT p50 / p99;
- single-request TPOT (``-n 4 --prompt-len 256:256 --output-len 256:256 --concurrency 1``)
  against its bandwidth floor (`tpot_floor_s`);
- `trtc serve`'s start-up, tuned against untuned (``benchmarks/startup.py``);
- speculative TPOT: ``benchmarks/speculative.py`` with the ``oracle`` proposer at K = 4, every
  draft accepted (``--force-accept``), one request, against a token a step."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from headline_artifacts import is_tuned
from headline_results import bench_case, bench_row, millis, tokens_per_s
from headline_runs import Headline, Options, Runner, shown

BENCH = Path(__file__).resolve().parent
LIMITS = {  # seconds a measurement may take at most (the run's budget may leave it less)
    "card": 120,
    "copy_bandwidth": 120,
    "mixed": 240,
    "server": 300,
    "hf": 420,
    "single": 180,
    "startup": 240,
    "speculative": 300,
}


def trtc(*args) -> list:
    return [sys.executable, "-m", "trtc", *args]


def python_code(code: str) -> list:
    return [sys.executable, "-c", code]


def card_name(runner: Runner, options: Options) -> str:
    """``torch.cuda.get_device_name()``, asked in a process of its own (this one keeps no CUDA
    context, which would hold memory the measured processes size their KV pools from)."""
    out = options.work / "card.json"
    out.unlink(missing_ok=True)
    code = (
        "import json, torch; json.dump(torch.cuda.get_device_name() if torch.cuda.is_available()"
        f" else 'no CUDA device', open({str(out)!r}, 'w'))"
    )
    try:
        runner.run(python_code(code), LIMITS["card"], options.log)
        return json.loads(out.read_text())
    except Exception as e:  # the run goes on; its entries say so
        return f"unknown ({type(e).__name__}: {e})"


def bandwidth(h: Headline) -> float | None:
    """The copy bandwidth measured in this run, bytes/s (None if it was not)."""
    entry = h.results.ok("copy_bandwidth")
    return entry["figures"]["bytes_per_s"] if entry else None


def tpot_floor_s(artifact: Path, bytes_per_s: float, prompt: int, output: int) -> float:
    """The bandwidth floor of a single request's time per output token: a decode step's bytes
    (`decode_profile.floor_bytes`: the weights a step reads and the K/V of its context, here
    the middle of the decode, ``prompt + output // 2`` tokens) over the copy bandwidth."""
    from decode_profile import floor_bytes

    from trtc.artifact import Artifact

    return floor_bytes(Artifact.open(artifact).manifest, 1, prompt + output // 2) / bytes_per_s


def bench_file(path: Path) -> tuple[dict, dict]:
    """A `trtc bench --json` file and its cases by mode (`bench_case`)."""
    raw = json.loads(path.read_text())
    return raw, {r["mode"]: bench_case(r) for r in raw["results"]}


def copy_bandwidth(h: Headline, artifact: None, name: str) -> None:
    out = h.file(f"{name}.json")
    code = (
        f"import json, sys; sys.path.insert(0, {str(BENCH)!r}); "
        "from timing import copy_bandwidth; "
        f"json.dump({{'bytes_per_s': copy_bandwidth()}}, open({str(out)!r}, 'w'))"
    )

    def body(seconds: float, log: Path) -> dict:
        h.runner.run(python_code(code), seconds, log)
        bw = json.loads(out.read_text())["bytes_per_s"]
        metric = "copy bandwidth (device-to-device copy of 4 GiB, bytes read + written)"
        return {"figures": {"bytes_per_s": bw}, "rows": [[metric, f"{bw / 1e12:.2f} TB/s"]]}

    command = "timing.copy_bandwidth() (benchmarks/timing.py: 4 GiB, median of do_bench)"
    h.step(name, command, body, LIMITS["copy_bandwidth"])


def mixed(h: Headline, artifact: Path, name: str, *, label: str) -> None:
    """The mixed workload in-process."""
    out = h.file(f"{name}.json")
    argv = trtc("bench", artifact, *h.options.workloads.mixed, "--mode", "inflight")

    def body(seconds: float, log: Path) -> dict:
        h.runner.run([*argv, "--json", out], seconds, log)
        raw, cases = bench_file(out)
        figures = {**cases["inflight"], "tuned": is_tuned(artifact)}
        return {
            "figures": figures,
            "rows": [bench_row(f"{label} mixed workload, in-process", figures)],
            "raw": raw,
        }

    h.step(name, shown(argv), body, LIMITS["mixed"])


def ratio_row(h: Headline, name: str, key: str, metric: str, value: float) -> list[list[str]]:
    """``[[metric, value / figure]]``, the figure ``key`` of this run's entry ``name``; no row
    if that entry did not succeed."""
    entry = h.results.ok(name)
    if entry is None:
        return []
    return [[f"{metric} (same run)", f"{value / entry['figures'][key]:.2f}x"]]


def mixed_server(h: Headline, artifact: Path, name: str) -> None:
    """The mixed workload through `trtc serve` (prefix caching off, as `trtc bench` runs
    in-process), the server started here and stopped after, its log kept."""
    import httpx  # (here, not above: --help and --table need neither this nor trtc)
    from startup import launch_server, stop_server, wait_healthy

    from trtc.runtime.distributed.rank_env import free_port

    port = free_port()
    url, serve = f"http://127.0.0.1:{port}", ("--no-prefix-caching",)
    out, server_log = h.file(f"{name}.json"), str(h.options.server_log)
    bench = trtc("bench", "--url", url, *h.options.workloads.mixed)

    def body(seconds: float, log: Path) -> dict:
        deadline = time.monotonic() + seconds
        client = httpx.Client(base_url=url, timeout=120)
        start = time.perf_counter()
        proc = launch_server(str(artifact), port, server_log, args=serve)
        h.runner.track(proc)
        try:
            healthy = wait_healthy(proc, client, start, server_log, seconds)
            h.runner.run([*bench, "--json", out], deadline - time.monotonic(), log)
        finally:
            client.close()
            stop_server(proc)
            h.runner.untrack(proc)
        raw, cases = bench_file(out)
        case = cases["server"]
        tok_s = case["output_tokens_per_s"]
        metric = "1.1B mixed workload: output tok/s through the server / in-process"
        ratio = ratio_row(h, "mixed_1b", "output_tokens_per_s", metric, tok_s)
        return {
            "figures": {**case, "healthy_s": healthy, "tuned": is_tuned(artifact)},
            "rows": [bench_row("1.1B mixed workload, through `trtc serve`", case), *ratio],
            "raw": raw,
        }

    command = f"{shown(trtc('serve', artifact, '--port', port, *serve))} & {shown(bench)}"
    h.step(name, command, body, LIMITS["server"])


def mixed_baseline(h: Headline, artifact: Path, name: str, *, baseline: str) -> None:
    """The mixed workload in-process, then transformers on the source model, same requests,
    same process: ``hf`` (`generate`, static batches of the concurrency) or ``hf-cb``
    (continuous batching, as many in flight)."""
    out = h.file(f"{name}.json")
    argv = trtc("bench", artifact, *h.options.workloads.mixed, "--mode", "inflight")
    argv += ["--baseline", baseline]
    n = h.options.workloads.concurrency()
    label = {
        "hf": f"transformers generate, static batches of {n}",
        "hf-cb": f"transformers continuous batching, {n} in flight",
    }[baseline]

    def body(seconds: float, log: Path) -> dict:
        h.runner.run([*argv, "--json", out], seconds, log)
        raw, cases = bench_file(out)
        ours, theirs = cases["inflight"], cases[{"hf": "hf-static", "hf-cb": "hf-cb"}[baseline]]
        ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        return {
            "figures": {"trtc": ours, "baseline": theirs, "ratio": ratio},
            "rows": [
                bench_row(f"1.1B mixed workload, {label}", theirs),
                [f"1.1B mixed workload: trtc in-process / {label} (same process)", f"{ratio:.2f}x"],
            ],
            "raw": raw,
        }

    h.step(name, shown(argv), body, LIMITS["hf"])


def single_tpot(
    h: Headline, artifact: Path, name: str, *, label: str, versus: tuple[str, str] | None = None
) -> None:
    """Single-request TPOT p50 against its bandwidth floor (when this run measured the copy
    bandwidth); with ``versus`` (an entry, the metric of a ratio), that entry's TPOT over this
    one's."""
    out = h.file(f"{name}.json")
    argv = trtc("bench", artifact, *h.options.workloads.single, "--mode", "inflight")

    def body(seconds: float, log: Path) -> dict:
        h.runner.run([*argv, "--json", out], seconds, log)
        raw, cases = bench_file(out)
        case, bw = cases["inflight"], bandwidth(h)
        tpot = case["tpot_s"]["p50"]
        figure = f"{millis(tpot)} ms ({tokens_per_s(case['output_tokens_per_s'])} output tok/s)"
        floor = None
        if bw:
            floor = tpot_floor_s(artifact, bw, *h.options.workloads.single_tokens())
            figure += f"; floor {millis(floor)} ms at {bw / 1e12:.2f} TB/s ({tpot / floor:.2f}x)"
        rows = [[f"single-request TPOT p50, {label}", figure]]
        if versus and (entry := h.results.ok(versus[0])):
            rows.append([versus[1], f"{entry['figures']['tpot_s']['p50'] / tpot:.2f}x"])
        figures = {**case, "tpot_floor_s": floor, "copy_bandwidth": bw, "tuned": is_tuned(artifact)}
        return {"figures": figures, "rows": rows, "raw": raw}

    h.step(name, shown(argv), body, LIMITS["single"])


def startup(h: Headline, artifact: Path, name: str) -> None:
    """`trtc serve` healthy after, and its first request, tuned against untuned
    (``benchmarks/startup.py``: each a fresh server with an empty cache)."""
    out = h.file(f"{name}.json")
    argv = [sys.executable, BENCH / "startup.py", artifact]

    def body(seconds: float, log: Path) -> dict:
        h.runner.run([*argv, "--json", out], seconds, log)
        raw = json.loads(out.read_text())
        by_case = {r["case"]: r for r in raw}
        tuned, untuned = by_case["tuned"], by_case["untuned"]
        figure = (
            f"{tuned['healthy_s']:.2f} s / {untuned['healthy_s']:.2f} s (first request, 8 tokens: "
            f"{millis(tuned['first_request_s'])} / {millis(untuned['first_request_s'])} ms)"
        )
        figures = {
            case: {k: r[k] for k in ("healthy_s", "first_request_s")} for case, r in by_case.items()
        }
        return {
            "figures": figures,
            "rows": [["`trtc serve` healthy after, 1.1B tuned / untuned", figure]],
            "raw": raw,
        }

    h.step(name, shown(argv), body, LIMITS["startup"])


def speculative(h: Headline, artifact: Path, name: str, *, label: str) -> None:
    """One request with the oracle proposer at K = 4, every draft accepted, against a token a
    step (``benchmarks/speculative.py``; the outputs checked identical)."""
    out = h.file(f"{name}.json")
    argv = [sys.executable, BENCH / "speculative.py", artifact, "--speculative", "oracle"]
    argv += ["--tokens", "4", "--concurrency", "1", *h.options.workloads.speculative]
    argv += ["--force-accept"]

    def body(seconds: float, log: Path) -> dict:
        h.runner.run([*argv, "--json", out], seconds, log)
        raw = json.loads(out.read_text())
        row = raw[0]
        spec, base = row["spec"]["tpot_ms"], row["base"]["tpot_ms"]
        figure = (
            f"{spec:.2f} / {base:.2f} ms ({row['tpot_ratio']:.2f}x), "
            f"{row['spec']['mean_accepted_length'] or 0:.2f} tokens per verifying step, "
            f"outputs identical: {'yes' if row['identical'] else 'no'}"
        )
        metric = f"speculative TPOT, {label}: oracle K=4, every draft accepted / a token a step"
        return {"figures": row, "rows": [[metric, figure]], "raw": raw}

    h.step(name, shown(argv), body, LIMITS["speculative"])


@dataclass(frozen=True)
class Measurement:
    key: str | None  # the artifact it measures (`headline_artifacts`), None for none
    about: str
    run: Callable[..., None]  # (Headline, artifact, name) -> None, the step recorded


INT4_VERSUS_FP16 = ("tpot_1b", "single-request TPOT, 1.1B: fp16 / INT4 (same run)")
MEASUREMENTS = {  # in the order they run: the headline figures first, the long ones last
    "copy_bandwidth": Measurement(None, "device copy bandwidth (timing.py)", copy_bandwidth),
    "mixed_1b": Measurement("1b", "1.1B mixed workload in-process", partial(mixed, label="1.1B")),
    "mixed_1b_server": Measurement("1b", "1.1B mixed workload through trtc serve", mixed_server),
    "tpot_1b": Measurement(
        "1b", "1.1B fp16 single-request TPOT, floor", partial(single_tpot, label="1.1B fp16")
    ),
    "tpot_1b_int4": Measurement(
        "1b_int4",
        "1.1B INT4 single-request TPOT, floor",
        partial(single_tpot, label="1.1B INT4 (RTN g128)", versus=INT4_VERSUS_FP16),
    ),
    "startup_1b": Measurement("1b", "trtc serve start-up, tuned / untuned (startup.py)", startup),
    "speculative_1b": Measurement(
        "1b", "1.1B speculative TPOT (speculative.py)", partial(speculative, label="1.1B fp16")
    ),
    "mixed_1b_hf": Measurement(
        "1b", "1.1B mixed workload, transformers static", partial(mixed_baseline, baseline="hf")
    ),
    "mixed_1b_hf_cb": Measurement(
        "1b", "1.1B mixed workload, transformers cont.", partial(mixed_baseline, baseline="hf-cb")
    ),
    "mixed_8b": Measurement("8b", "8B mixed workload in-process", partial(mixed, label="8B")),
    "tpot_8b": Measurement(
        "8b", "8B fp16 single-request TPOT, floor", partial(single_tpot, label="8B fp16")
    ),
    "speculative_8b": Measurement(
        "8b", "8B speculative TPOT (speculative.py)", partial(speculative, label="8B fp16")
    ),
}
EIGHT_B = tuple(name for name, m in MEASUREMENTS.items() if m.key == "8b")
