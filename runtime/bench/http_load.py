"""A running `trtc serve` driven through HTTP: the request set split among load generator
processes, summarized as in-process, with the cores each side kept busy and the server's memory
read from its /metrics."""

from __future__ import annotations

from trtc.runtime.bench.load_generator import LoadShare, auth_headers, timed_share
from trtc.runtime.bench.load_processes import run_share_processes
from trtc.runtime.bench.request_sets import BenchRequest
from trtc.runtime.bench.summary import summarize


def model_card(url: str, api_key: str | None = None) -> dict:
    """The first model the server at ``url`` lists (/v1/models): its id, and trtc's vocabulary
    size and special token ids."""
    import httpx

    models = httpx.get(f"{url.rstrip('/')}/v1/models", headers=auth_headers(api_key))
    return models.json()["data"][0]


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
    generator is that many processes (`run_share_processes`), each with every
    ``processes``-th request, its share of the concurrency (and of the rate), started
    together."""
    url = url.rstrip("/")
    model = model_card(url, api_key)["id"]
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
        timings, client_cpu, start, end = timed_share(shares[0])
        wall = end - start
    else:
        timings, wall, client_cpu = run_share_processes(shares)
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


def _server_metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of the server's /metrics."""
    import httpx

    samples = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            samples[name] = float(value)
    return samples
