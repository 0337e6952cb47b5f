"""What `trtc bench` shows of its results: the table's title and rows (a metric per row, a
result per column), the first result compared with each other one in words, and the JSON
document ``--json`` writes."""

from __future__ import annotations

LATENCIES = (("ttft_s", "TTFT ms"), ("tpot_s", "TPOT ms"), ("itl_s", "ITL ms"), ("e2e_s", "E2E ms"))
CPU_SIDES = ("client_cpu_cores", "server_cpu_cores", "engine_cpu_cores")


def milliseconds(seconds: float | None) -> str:
    """A latency for the bench table, in ms: three decimals under 10 ms (a decode step's TPOT
    is a fraction of a millisecond), one above; "-" where there is none."""
    if seconds is None:
        return "-"
    ms = seconds * 1000
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def title(num_requests: int, prompt_len: str, output_len: str, seed: int, text: str | None) -> str:
    """The table's title: the request set (lengths as given on the command line)."""
    source = f" (text: {text})" if text else ""
    return (
        f"trtc bench: {num_requests} requests, prompts {prompt_len}{source}, "
        f"outputs {output_len}, seed {seed}"
    )


def table_rows(results: list[dict]) -> list[list[str]]:
    """The table's rows, each a metric's label and its value in each result: throughput,
    latency percentiles, duration and memory; the cores each side kept busy when the results
    came through a server, and the tokens per verifying step when one speculated."""
    rows = [
        ["requests/s", *[f"{r['requests_per_s']:.2f}" for r in results]],
        ["output tokens/s", *[f"{r['output_tokens_per_s']:.1f}" for r in results]],
    ]
    for key, label in LATENCIES:
        for p in ("p50", "p90", "p99"):
            rows.append([f"{label} {p}", *[milliseconds(r[key][p]) for r in results]])
    rows += [
        ["duration s", *[f"{r['duration_s']:.1f}" for r in results]],
        [
            "peak KV MB",
            *[
                f"{r['peak_kv_mb']:.1f}" if r.get("peak_kv_mb") is not None else "-"
                for r in results
            ],
        ],
        [
            "peak RSS MB",
            *[f"{r['peak_rss_mb']:.0f}" if r.get("peak_rss_mb") else "-" for r in results],
        ],
    ]
    if any(CPU_SIDES[0] in r for r in results):  # runs through a server
        cores = [" / ".join(f"{r[k]:.2f}" if k in r else "-" for k in CPU_SIDES) for r in results]
        rows.append(["CPU cores client / server / engine", *cores])
        rows.append(["client processes", *[str(r.get("client_processes", "-")) for r in results]])
    if any(r.get("spec") for r in results):
        accepted = [
            f"{r['spec']['mean_accepted_length']:.2f}" if r.get("spec") else "-" for r in results
        ]
        rows.append(["tokens per verifying step", *accepted])
    return rows


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


def json_document(
    results: list[dict],
    num_requests: int,
    prompt_len: str,
    output_len: str,
    seed: int,
    concurrency: int,
) -> dict:
    """What ``--json`` writes: the request set and concurrency as given, and every result."""
    return {
        "requests": num_requests,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "seed": seed,
        "concurrency": concurrency,
        "results": results,
    }
