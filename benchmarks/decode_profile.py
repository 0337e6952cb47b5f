"""Where a decode step's GPU time goes: the CUDA executor's captured decode graph timed on its own
(no host work), against the bandwidth floor, and the kernels of the same step with their device
times (torch.profiler on an eager run of the step; a graph replays the same kernels).

    python3 benchmarks/decode_profile.py ARTIFACT [--batch 1,64] [--context 256] [--unfused]
        [--no-int4-fragments] [--prefill 512] [--ab] [--json FILE]

It also prints the weight bytes the executor holds on the device (after its load-time
rewrites) and, with ``--prefill N``, the time of one eager prefill step of ``N`` tokens (one
sequence, nothing cached).

``--ab`` re-captures the graphs with programmatic dependent launch and the Triton GEMV each
turned off and on (`trtc.plugins.kernels.pdl`, `plugins/kernels/gemv.py`) and times every combination in
the same run.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from trtc.contract import SequenceWork, make_step


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.randn(int(gib * 2**30) // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (_median_ms(lambda: dst.copy_(src)) * 1e-3)


def _median_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
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


def decode_step(executor, batch: int, context: int) -> dict[str, torch.Tensor]:
    """``batch`` sequences of ``context`` cached tokens, one new token each, on disjoint blocks."""
    bs = executor.block_size
    per_seq = -(-(context + 1) // bs)
    if batch * per_seq > executor.num_blocks:
        raise SystemExit(
            f"the KV pool ({executor.num_blocks} blocks) is too small for {batch} x {context}"
        )
    work = [
        SequenceWork([1 + b], context, list(range(b * per_seq, (b + 1) * per_seq)))
        for b in range(batch)
    ]
    return make_step(work, bs)


def prefill_ms(executor, tokens: int) -> float:
    """Median time of one prefill step of ``tokens`` new tokens of one sequence (eager)."""
    limits = executor.manifest["limits"]
    most = min(limits["max_seq_len"], limits["max_num_tokens"])
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
    return _median_ms(lambda: executor.execute(step), reps=10)


def device_constant_bytes(executor) -> int:
    """Bytes of the constants (weights and the tables made from them) on the device."""
    return sum(
        t.numel() * t.element_size() for t in executor.constants.values() if t.device.type == "cuda"
    )


def kernel_table(
    executor, step: dict[str, torch.Tensor]
) -> tuple[list[tuple[str, int, float]], float]:
    """``[(kernel, launches, total device us)]`` of one eager step, most expensive first."""
    from torch.profiler import ProfilerActivity, profile

    inputs = {k: v.to(executor.device) for k, v in step.items()}
    executor.forward(inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        executor.forward(inputs)
        torch.cuda.synchronize()
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += 1
            by_name[e.name][1] += (
                e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            )
    rows = sorted(((n, c, t) for n, (c, t) in by_name.items()), key=lambda r: -r[2])
    return rows, sum(t for _, _, t in rows)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    from trtc.runtime.executors.cuda_executor import CudaExecutor

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--batch", default="1,64")
    p.add_argument("--context", type=int, default=256)
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
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    ex = CudaExecutor(
        args.artifact,
        max_graph_batch=max(batches),
        fuse_kernels=not args.unfused,
        int4_fragments=False if args.no_int4_fragments else None,
        memory_fraction=0.5,
    )
    manifest = ex.manifest
    bw = copy_bandwidth()
    # A decode step reads every weight once, except the embedding table (only its rows), unless
    # the LM head is that table.
    wb = manifest["graph"]["weight_bytes"]
    tied = manifest["model"]["tie_word_embeddings"]
    weight_bytes = wb["total"] - (0 if tied else wb.get("embedding", 0)) - wb.get("rope_tables", 0)
    kv_per_token = manifest["kv_cache"]["bytes_per_token"]
    print(
        f"{manifest['name']}: copy bandwidth {bw / 1e12:.2f} TB/s, weights read per step "
        f"{weight_bytes / 1e9:.2f} GB, fusions {ex.fusions or 'none'}"
    )
    held = device_constant_bytes(ex)
    print(
        f"weights held on the device: {held / 1e9:.3f} GB (the artifact's: "
        f"{wb['total'] / 1e9:.3f} GB)"
    )
    report = {
        "copy_bandwidth": bw,
        "fusions": ex.fusions,
        "device_constant_bytes": held,
        "steps": [],
    }
    if args.prefill:
        report["prefill"] = {"tokens": args.prefill, "ms": prefill_ms(ex, args.prefill)}
        print(f"prefill of {args.prefill} tokens: {report['prefill']['ms']:.2f} ms")
    for batch in batches:
        step = decode_step(ex, batch, args.context)
        graph, inputs, logits = ex.graphs[next(b for b in sorted(ex.graphs) if b >= batch)]
        inputs.load(step)
        graph_ms = _median_ms(graph.replay)
        step_ms = _median_ms(
            lambda: ex.execute(step).argmax(-1).tolist()
        )  # + loading and token ids back
        floor_ms = (weight_bytes + batch * (args.context + 1) * kv_per_token) / bw * 1e3
        rows, kernel_us = kernel_table(ex, step)
        launches = sum(c for _, c, _ in rows)
        print(
            f"\nbatch {batch}, context {args.context}: graph replay {graph_ms * 1e3:.0f} us, floor "
            f"{floor_ms * 1e3:.0f} us ({graph_ms / floor_ms:.2f}x); execute + argmax to host "
            f"{step_ms * 1e3:.0f} us; {launches} kernels, {kernel_us:.0f} us of kernel time "
            f"(gaps {graph_ms * 1e3 - kernel_us:.0f} us)"
        )
        for name, count, us in rows[:14]:
            print(f"  {us:8.1f} us  {count:4d} x  {name[:90]}")
        report["steps"].append(
            {
                "batch": batch,
                "context": args.context,
                "graph_us": graph_ms * 1e3,
                "execute_us": step_ms * 1e3,
                "floor_us": floor_ms * 1e3,
                "kernels": launches,
                "kernel_us": kernel_us,
                "top": [{"kernel": n, "count": c, "us": t} for n, c, t in rows[:30]],
            }
        )
    if args.ab:
        report["ab"] = ab_graph_times(ex, batches, args.context)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def ab_graph_times(ex, batches: list[int], context: int) -> list[dict]:
    """Graph replay time per batch with PDL and the GEMV each on and off (graphs re-captured
    for each; the last combination is the default again, so the spread shows the noise)."""
    from trtc.plugins.kernels import gemv, pdl

    default_gemv = gemv.MAX_TOKENS
    was = pdl.set_enabled(True)
    rows = []
    print(f"\nA/B (graph replay, us): batch {', '.join(map(str, batches))}")
    for use_pdl, gemv in ((False, False), (True, False), (False, True), (True, True)):
        pdl.set_enabled(use_pdl)
        gemv.MAX_TOKENS = default_gemv if gemv else 0
        ex.capture_graphs()
        times = []
        for batch in batches:
            graph, inputs, _ = ex.graphs[next(b for b in sorted(ex.graphs) if b >= batch)]
            inputs.load(decode_step(ex, batch, context))
            times.append(_median_ms(graph.replay) * 1e3)
        rows.append({"pdl": use_pdl, "gemv": gemv, "graph_us": dict(zip(batches, times))})
        print(
            f"  PDL {'on ' if use_pdl else 'off'}  projections {'GEMV  ' if gemv else 'cuBLAS'}: "
            + ", ".join(f"{t:.0f}" for t in times)
        )
    pdl.set_enabled(was)
    gemv.MAX_TOKENS = default_gemv
    ex.capture_graphs()
    return rows


if __name__ == "__main__":
    main()
