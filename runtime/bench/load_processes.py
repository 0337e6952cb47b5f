"""The load generator spread over processes started together: one Python process parsing 64
streams of SSE chunks at ~20k tokens/s is itself near a core, and a client that falls behind
delays the next request of each stream, which shows as the server's throughput."""

from __future__ import annotations

import os
import time

from trtc.runtime.bench.load_generator import LoadShare, timed_share
from trtc.runtime.bench.summary import RequestTiming
from trtc.runtime.engine.process_exit import exit_reason


def default_load_processes(concurrency: int) -> int:
    """Processes the load generator spreads its streams over by default: one per 16 streams,
    at most 4, and at most half the CPUs (the server and its engine need theirs)."""
    return max(1, min(4, concurrency // 16, (os.cpu_count() or 2) // 2))


def run_share_processes(shares: list[LoadShare]) -> tuple[list[RequestTiming], float, float]:
    """`timed_share` in a process per share, started together: the timings of all, the wall
    time from their common start to the last one's end, and the CPU seconds they used."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # (a forked child would inherit this process's threads)
    go, messages = ctx.Event(), ctx.Queue()
    workers = [
        ctx.Process(
            target=_share_process,
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


def _share_process(share: LoadShare, go, messages) -> None:
    """One load generator process (`run_share_processes`): says it is ready, waits for the
    others, runs its share, and puts (timings, CPU seconds, end time), or the error as text."""
    import httpx  # noqa: F401  (imported before the start, not in the timed part)

    messages.put("ready")
    go.wait()
    try:
        timings, cpu, _, end = timed_share(share)
    except Exception as e:  # (sent as text: not every exception pickles)
        messages.put((f"{type(e).__name__}: {e}", 0.0, time.perf_counter()))
        return
    messages.put((timings, cpu, end))
