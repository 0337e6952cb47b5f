"""The timing every benchmark here shares (GPU only): the device's copy bandwidth, the figure the
weight- and KV-streaming kernels are measured against, and medians of CUDA-timed calls, one at a
time (`median_ms`) or captured back to back in a CUDA graph (`per_call_us`).

The scripts beside this file import it as ``import timing`` / ``from timing import ...``: run as
``python3 benchmarks/NAME.py``, a script has ``benchmarks/`` on ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Bytes of weight sets a timing rotates through, each call reading a different set: four times
# the 50 MB L2 of an H100 / H200, so no call finds its weight in L2 from an earlier call.
ROTATION_BYTES = 200e6


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes read + written per second by a device-to-device copy of ``gib`` GiB (fp32 ``copy_``).

    Method: the median of ``triton.testing.do_bench`` (50 ms of warm-up, then 200 ms of
    repetitions, each timed with CUDA events), as the kernels' figures in
    docs/benchmarks-journal.md and docs/gpu-kernels.md were measured (4 GiB). A copy this large
    is far past L2, so the figure is DRAM bandwidth; a script that shares the GPU's memory with
    a loaded model may pass a smaller ``gib``."""
    import triton.testing

    src = torch.randn(int(gib * 2**30) // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def median_ms(fn: Callable[[], object], reps: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()``, each call timed on its own with CUDA events and waited
    for before the next starts (``warmup`` untimed calls first): what one call costs as a step
    runs it, host work included (an executor's step, a replay plus the token ids copied back),
    where ``do_bench`` would queue the calls behind each other."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def per_call_us(calls: Sequence[Callable[[], object]], warmup: int = 10, rep: int = 40) -> float:
    """Median microseconds per call of ``calls`` captured back to back in one CUDA graph: the
    graph's replay timed by ``triton.testing.do_bench`` (``warmup`` / ``rep`` milliseconds),
    divided by the number of calls. Launches as a captured decode step runs them, with no host
    gaps; give each call its own weight set (`ROTATION_BYTES`) to time reads from DRAM.

    The calls run twice on a side stream first (compiling the kernels, settling the
    allocator), as the CUDA executor does before it captures."""
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
    del graph
    return ms * 1e3 / len(calls)
