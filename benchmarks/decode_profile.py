"""Where a decode step's GPU time goes: the CUDA executor's captured decode graph timed on its own
(no host work), against the bandwidth floor, and the kernels of the same step with their device
times (torch.profiler on an eager run of the step; a graph replays the same kernels).

    python3 benchmarks/decode_profile.py ARTIFACT [--batch 1,64] [--context 256] [--unfused]
        [--no-int4-fragments] [--prefill 512] [--chunk 384 [--chunk-context 0]] [--ab]
        [--timeline] [--json FILE]

It also prints the weight bytes the executor holds on the device (after its load-time
rewrites) and, with ``--prefill N``, the time of one eager prefill step of ``N`` tokens (one
sequence, nothing cached); with ``--chunk N``, a mixed step of each batch's decode rows and one
prompt chunk of ``N`` tokens (``--chunk-context`` cached before it), as the engine runs it
(``execute``: from the mixed-step graphs where one holds it) and its kernels.

``--timeline`` profiles replays of each batch's decode graph itself and charges every kernel its
marginal time: its end minus the latest end of the kernels before it (none where it ended first),
so that the charges sum to the replay however much the kernels overlap (under PDL each starts
while the one before it runs); beside it, how long before that latest end the kernel started
(its lead) and how long it ran. The eager table above shows what each kernel costs alone, this
one what it adds to the step (docs/gpu-kernels.md, "What the step's tails wait on").

``--ab`` re-captures the graphs with programmatic dependent launch and the Triton GEMV each
turned off and on (`trtc.plugins.kernels.pdl`, `trtc.plugins.kernels.gemv`) and times every
combination in the same run.

Timing (`timing.py`): graph replays and steps by CUDA events, one call at a time (`median_ms`);
the bandwidth floor from a 2 GiB copy (`copy_bandwidth`), the GPU's memory being shared with
the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trtc.artifact import Artifact, Manifest
from trtc.contract import SequenceWork, StepInputs, make_step
from trtc.plugins.kernels import gemv, pdl
from trtc.runtime.executors.cuda_executor import CudaExecutor

from timing import copy_bandwidth, median_ms

COPY_GIB = 2.0  # the copy that measures the bandwidth: the model holds the rest of the memory
TIMELINE_REPLAYS = 5  # `--timeline`: the replays profiled; the one of median span is reported


def decode_step(
    executor: CudaExecutor, batch: int, context: int, chunk: int = 0, chunk_context: int = 0
) -> StepInputs:
    """``batch`` sequences of ``context`` cached tokens, one new token each, on disjoint blocks;
    with ``chunk``, then one sequence with ``chunk`` new tokens after ``chunk_context`` cached
    (a mixed step)."""
    bs = executor.block_size
    per_seq = -(-(context + 1) // bs)
    chunk_blocks = -(-(chunk_context + chunk) // bs) if chunk else 0
    if batch * per_seq + chunk_blocks > executor.num_blocks:
        raise SystemExit(
            f"the KV pool ({executor.num_blocks} blocks) is too small for {batch} x {context}"
            + (f" and a chunk of {chunk} after {chunk_context}" if chunk else "")
        )
    work = [
        SequenceWork([1 + b], context, list(range(b * per_seq, (b + 1) * per_seq)))
        for b in range(batch)
    ]
    if chunk:
        first = batch * per_seq
        ids = [1 + t % 1000 for t in range(chunk)]
        work.append(SequenceWork(ids, chunk_context, list(range(first, first + chunk_blocks))))
    return make_step(work, bs)


def step_weight_bytes(manifest: Manifest) -> int:
    """Weight bytes a decode step reads: every weight once, except the embedding table (only its
    rows), unless the LM head is that table, and the rotary tables."""
    wb = manifest.graph.weight_bytes
    tied = manifest.model.tie_word_embeddings
    return wb["total"] - (0 if tied else wb.get("embedding", 0)) - wb.get("rope_tables", 0)


def floor_bytes(manifest: Manifest, batch: int, context: int) -> int:
    """What a decode step of ``batch`` sequences of ``context`` cached tokens must read: its
    weights and every sequence's K/V with the new token's; over the copy bandwidth, the
    bandwidth floor of the step."""
    return step_weight_bytes(manifest) + batch * (context + 1) * manifest.kv_cache.bytes_per_token


def decode_graph(executor: CudaExecutor, batch: int, step: StepInputs) -> torch.cuda.CUDAGraph:
    """The captured decode graph that ``step``, of ``batch`` sequences, replays (the smallest
    size that holds it), with ``step`` loaded into its inputs."""
    graph, inputs, _ = executor.decode.graphs[executor.decode.pick(batch)]
    inputs.load(step)
    return graph


def prefill_ms(executor: CudaExecutor, tokens: int) -> float:
    """Median time of one prefill step of ``tokens`` new tokens of one sequence (eager)."""
    limits = executor.manifest.limits
    most = min(limits.max_seq_len, limits.max_num_tokens)
    if tokens > most:
        raise SystemExit(
            f"--prefill {tokens}: the artifact takes at most {most} tokens a step "
            f"(limits.max_seq_len / max_num_tokens)"
        )
    bs = executor.block_size
    blocks = -(-tokens // bs)
    if blocks > executor.num_blocks:
        raise SystemExit(
            f"the KV pool ({executor.num_blocks} blocks) is too small for a {tokens}-token prefill"
        )
    step = make_step(
        [SequenceWork([1 + t % 1000 for t in range(tokens)], 0, list(range(blocks)))], bs
    )
    return median_ms(lambda: executor.execute(step), reps=10)


def device_constant_bytes(executor: CudaExecutor) -> int:
    """Bytes of the constants (weights and the tables made from them) on the device."""
    return sum(
        t.numel() * t.element_size() for t in executor.constants.values() if t.device.type == "cuda"
    )


def device_events(prof) -> list:
    """The GPU's records (kernels) of a torch.profiler run, each with its start and end
    (``time_range``, us)."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_table(
    executor: CudaExecutor, step: StepInputs
) -> tuple[list[tuple[str, int, float]], float]:
    """``[(kernel, launches, total device us)]`` of one eager step, most expensive first."""
    from torch.profiler import ProfilerActivity, profile

    inputs = step.to(executor.device).as_dict()
    executor.forward(inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        executor.forward(inputs)
        torch.cuda.synchronize()
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in device_events(prof):
        by_name[e.name][0] += 1
        by_name[e.name][1] += (
            e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        )
    rows = sorted(((n, c, t) for n, (c, t) in by_name.items()), key=lambda r: -r[2])
    return rows, sum(t for _, _, t in rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("artifact", help="the artifact directory (trtc build's output)")
    p.add_argument(
        "--batch", default="1,64", help="decode batch sizes, comma-separated (default 1,64)"
    )
    p.add_argument(
        "--context", type=int, default=256, help="cached tokens of each sequence (default 256)"
    )
    p.add_argument(
        "--unfused", action="store_true", help="run the graph as compiled (no kernel fusion)"
    )
    p.add_argument(
        "--no-int4-fragments",
        action="store_true",
        help="keep Int4Gemm on the plugin-layout kernels (no fragment-layout weights)",
    )
    p.add_argument(
        "--ab",
        action="store_true",
        help="also time the graphs without PDL and/or with cuBLAS for the few-token projections",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="also time one eager prefill step of this many tokens",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="also time each batch's decode rows with one prompt chunk of this many tokens (a "
        "mixed step)",
    )
    p.add_argument(
        "--chunk-context",
        type=int,
        default=0,
        help="cached tokens before the --chunk prompt chunk (default 0)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also profile replays of each decode graph and charge each kernel what it adds to "
        "the step (its end minus the latest end before it)",
    )
    p.add_argument("--json", default=None, help="write the measurements here (JSON)")
    return p.parse_args(argv)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    ex = CudaExecutor(
        Artifact.open(args.artifact),
        max_graph_batch=max(batches),
        fuse_kernels=not args.unfused,
        int4_fragments=False if args.no_int4_fragments else None,
        memory_fraction=0.5,
    )
    bw = copy_bandwidth(COPY_GIB)
    report = weights_report(ex, bw)
    if args.prefill:
        report["prefill"] = {"tokens": args.prefill, "ms": prefill_ms(ex, args.prefill)}
        print(f"prefill of {args.prefill} tokens: {report['prefill']['ms']:.2f} ms")
    # Every timing before the first profile (torch.profiler): batches timed after one came out
    # 14-18% slower than the same graphs timed in a process that had not profiled
    # (docs/benchmarks-journal.md, 2026-12-07, 12:10-12:50 UTC).
    timed = [time_batch(ex, batch, args) for batch in batches]
    if args.ab:
        report["ab"] = ab_graph_times(ex, batches, args.context)
    report["steps"] = [profile_batch(ex, args, timing, bw) for timing in timed]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def weights_report(ex: CudaExecutor, bw: float) -> dict:
    """Print the copy bandwidth ``bw``, the weight bytes a decode step reads and those the
    executor holds on the device; returns the report so far."""
    manifest = ex.manifest
    total = manifest.graph.weight_bytes["total"]
    print(
        f"{manifest.name}: copy bandwidth {bw / 1e12:.2f} TB/s, weights read per step "
        f"{step_weight_bytes(manifest) / 1e9:.2f} GB, fusions {ex.fusions or 'none'}"
    )
    held = device_constant_bytes(ex)
    print(f"weights held on the device: {held / 1e9:.3f} GB (the artifact's: {total / 1e9:.3f} GB)")
    return {
        "copy_bandwidth": bw,
        "fusions": ex.fusions,
        "device_constant_bytes": held,
        "steps": [],
    }


@dataclass
class BatchTiming:
    """A decode batch's timings, all taken before any profile: its graph's replay, its step
    as the engine runs it with the token ids copied back and, with ``--chunk``, its step with
    a prompt chunk added (``chunk``) as the engine runs it."""

    batch: int
    step: StepInputs
    graph_ms: float
    step_ms: float
    chunk: StepInputs | None
    chunk_ms: float | None


def time_batch(ex: CudaExecutor, batch: int, args: argparse.Namespace) -> BatchTiming:
    """`BatchTiming` of a decode step of ``batch`` sequences of ``--context`` cached tokens."""
    step = decode_step(ex, batch, args.context)
    graph_ms = median_ms(decode_graph(ex, batch, step).replay)

    def step_to_host() -> list[int]:  # + loading, token ids back
        return ex.execute(step).argmax(-1).tolist()

    chunk, chunk_ms = None, None
    if args.chunk:  # as the engine runs it: host work, a mixed-step graph where one holds it
        chunk = decode_step(ex, batch, args.context, args.chunk, args.chunk_context)
        chunk_ms = median_ms(lambda: ex.execute(chunk), reps=20)
    return BatchTiming(batch, step, graph_ms, median_ms(step_to_host), chunk, chunk_ms)


def profile_batch(
    ex: CudaExecutor, args: argparse.Namespace, timing: BatchTiming, bw: float
) -> dict:
    """Print and return a batch's report: its ``timing`` against the bandwidth floor (``bw``),
    the kernels of its step (eager) and, as asked, its replay timeline and chunk step."""
    batch, graph_ms, step_ms = timing.batch, timing.graph_ms, timing.step_ms
    floor_ms = floor_bytes(ex.manifest, batch, args.context) / bw * 1e3
    rows, kernel_us = kernel_table(ex, timing.step)
    launches = sum(c for _, c, _ in rows)
    print(
        f"\nbatch {batch}, context {args.context}: graph replay {graph_ms * 1e3:.0f} us, floor "
        f"{floor_ms * 1e3:.0f} us ({graph_ms / floor_ms:.2f}x); execute + argmax to host "
        f"{step_ms * 1e3:.0f} us; {launches} kernels, {kernel_us:.0f} us of kernel time "
        f"(gaps {graph_ms * 1e3 - kernel_us:.0f} us)"
    )
    for name, count, us in rows[:14]:
        print(f"  {us:8.1f} us  {count:4d} x  {name[:90]}")
    report = {
        "batch": batch,
        "context": args.context,
        "graph_us": graph_ms * 1e3,
        "execute_us": step_ms * 1e3,
        "floor_us": floor_ms * 1e3,
        "kernels": launches,
        "kernel_us": kernel_us,
        "top": [{"kernel": n, "count": c, "us": t} for n, c, t in rows[:30]],
    }
    if args.timeline:
        report["timeline"] = graph_timeline(ex, batch, timing.step)
    if args.chunk:
        report["chunk"] = mixed_step(ex, batch, args, timing.chunk, timing.chunk_ms)
    return report


def replay_timeline(kernels: Sequence[tuple[str, float, float]], replays: int) -> dict:
    """What each kernel adds to a graph replay. ``kernels``: ``(name, start, duration)`` (us) of
    ``replays`` replays of one graph, each waited for before the next (so the same kernels each
    time, and no replay overlaps another). The replay of median span is charged: each kernel, in
    order of start, its marginal time (its end minus the latest end before it, at least 0: the
    charges sum to the span) and its lead (that latest end minus its start: how long it ran
    beside the kernels before it; negative where it started after them). Grouped by kernel and
    the kernel before it: launches, the median lead, duration and marginal time, and the
    marginal time of all."""
    if not kernels or len(kernels) % replays:
        raise ValueError(f"{len(kernels)} kernels is not {replays} replays of the same graph")
    ordered = sorted(kernels, key=lambda k: k[1])
    per = len(ordered) // replays
    charged = []
    for r in range(replays):
        rows, latest, before = [], ordered[r * per][1], None
        for name, start, duration in ordered[r * per : (r + 1) * per]:
            end = start + duration
            rows.append((name, before, latest - start, duration, max(0.0, end - latest)))
            latest, before = max(latest, end), name
        charged.append((latest - ordered[r * per][1], rows))
    span, rows = sorted(charged, key=lambda c: c[0])[replays // 2]
    groups: dict[tuple[str, str | None], list] = defaultdict(list)
    for name, before, lead, duration, marginal in rows:
        groups[(name, before)].append((lead, duration, marginal))
    table = [
        {
            "kernel": name,
            "after": before,
            "launches": len(g),
            "lead_us": statistics.median(x[0] for x in g),
            "duration_us": statistics.median(x[1] for x in g),
            "marginal_us": statistics.median(x[2] for x in g),
            "marginal_all_us": sum(x[2] for x in g),
        }
        for (name, before), g in groups.items()
    ]
    table.sort(key=lambda t: -t["marginal_all_us"])
    return {"kernels": per, "span_us": span, "table": table}


def graph_timeline(ex: CudaExecutor, batch: int, step: StepInputs) -> dict:
    """`replay_timeline` of the decode graph of ``batch`` replaying ``step`` (torch.profiler's
    kernel records of `TIMELINE_REPLAYS` replays), printed and returned."""
    from torch.profiler import ProfilerActivity, profile

    graph = decode_graph(ex, batch, step)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(TIMELINE_REPLAYS):
            graph.replay()
            torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in device_events(prof)]
    timeline = replay_timeline(kernels, TIMELINE_REPLAYS)
    print(
        f"  replay timeline ({timeline['kernels']} kernels, the median of {TIMELINE_REPLAYS} "
        f"replays: {timeline['span_us']:.1f} us); marginal us in all, launches, medians of a "
        f"launch: lead, duration, marginal"
    )
    for t in timeline["table"][:14]:
        after = t["after"][:30] if t["after"] else "(first)"
        print(
            f"  {t['marginal_all_us']:8.1f} us  {t['launches']:4d} x  lead {t['lead_us']:5.1f}  "
            f"ran {t['duration_us']:6.1f}  adds {t['marginal_us']:5.1f}  "
            f"{t['kernel'][:40]} (after {after})"
        )
    return timeline


def mixed_step(ex: CudaExecutor, batch: int, args, step: StepInputs, ms: float) -> dict:
    """The report of ``step``, the decode step of ``batch`` with one prompt chunk (``--chunk``)
    added: its time ``ms`` as the engine runs it (`execute`, no token ids copied back; timed
    by `main` before any profile) and its kernels (eager)."""
    rows, kernel_us = kernel_table(ex, step)
    print(
        f"\nbatch {batch} + a chunk of {args.chunk} after {args.chunk_context} cached: execute "
        f"{ms * 1e3:.0f} us; {sum(c for _, c, _ in rows)} kernels, {kernel_us:.0f} us of kernel "
        f"time (eager)"
    )
    for name, count, us in rows[:14]:
        print(f"  {us:8.1f} us  {count:4d} x  {name[:90]}")
    return {
        "tokens": args.chunk,
        "chunk_context": args.chunk_context,
        "execute_us": ms * 1e3,
        "kernel_us": kernel_us,
        "top": [{"kernel": n, "count": c, "us": t} for n, c, t in rows[:30]],
    }


def ab_graph_times(ex: CudaExecutor, batches: list[int], context: int) -> list[dict]:
    """Graph replay time per batch with PDL and the GEMV each on and off (graphs re-captured
    for each; the last combination is the default again, so the spread shows the noise)."""
    default_gemv = gemv.max_tokens()
    was = pdl.set_enabled(True)
    rows = []
    print(f"\nA/B (graph replay, us): batch {', '.join(map(str, batches))}")
    for use_pdl, use_gemv in ((False, False), (True, False), (False, True), (True, True)):
        pdl.set_enabled(use_pdl)
        gemv.set_max_tokens(default_gemv if use_gemv else 0)
        ex.capture_graphs(mixed=False)
        times = []
        for batch in batches:
            graph = decode_graph(ex, batch, decode_step(ex, batch, context))
            times.append(median_ms(graph.replay) * 1e3)
        rows.append({"pdl": use_pdl, "gemv": use_gemv, "graph_us": dict(zip(batches, times))})
        print(
            f"  PDL {'on ' if use_pdl else 'off'}  "
            f"projections {'GEMV  ' if use_gemv else 'cuBLAS'}: "
            + ", ".join(f"{t:.0f}" for t in times)
        )
    pdl.set_enabled(was)
    gemv.set_max_tokens(default_gemv)
    ex.capture_graphs()
    return rows


if __name__ == "__main__":
    main()
