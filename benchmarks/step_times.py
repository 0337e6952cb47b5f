"""Where a served workload's GPU time goes, step by step: the in-process mixed workload of `trtc
bench` (the same requests, the same engine loop), with a CUDA event recorded before and after
each step's ``execute``, summed by kind of step (decode-only by batch size, prefill / mixed by
tokens), at one or more token budgets of one engine (``max_num_batched_tokens``). Each budget's run
follows an untimed warm-up that runs a step of the whole budget, so that the kernels of the
eager steps (those longer than the largest prefill graph) are compiled before it on an untuned
artifact.

    python3 benchmarks/step_times.py ARTIFACT [--budgets 4096,1024] [-n 256]
        [--prompt-len 128:1024] [--output-len 32:512] [--concurrency 64] [--json FILE]

What it tells: whether the GPU is busy (busy time over wall time; the host's share is the rest),
and which kind of step the time goes to, so that a kernel's profile (`decode_profile.py`, with
``--chunk`` for a mixed step) can be weighed by how often its step runs. The events themselves
cost the engine nothing it waits for: they are read after each run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from trtc.cli import _range
from trtc.runtime import bench
from trtc.runtime.engine import EngineConfig, LLMEngine

# Decode steps by batch size, prefill / mixed steps by tokens (upper bounds of each class).
DECODE_CLASSES = (16, 48)
MIXED_CLASSES = (512, 1024, 1536, 2048, 4096)


def step_class(num_tokens: int, num_seqs: int) -> str:
    """The kind of a step of ``num_tokens`` over ``num_seqs`` sequences, e.g. "decode, batch <=
    16" or "mixed, tokens > 4096"."""
    kind, size, bounds = (
        ("decode, batch", num_seqs, DECODE_CLASSES)
        if num_tokens == num_seqs
        else ("mixed, tokens", num_tokens, MIXED_CLASSES)
    )
    top = next((b for b in bounds if size <= b), None)
    return f"{kind} <= {top}" if top is not None else f"{kind} > {bounds[-1]}"


class StepTimer:
    """Wraps ``executor.execute``: events before and after each step, read by `summary`."""

    def __init__(self, executor):
        self.execute = executor.execute
        self.records: list[tuple[torch.cuda.Event, torch.cuda.Event, str]] = []
        executor.execute = self._execute

    def _execute(self, step, *args, **kwargs):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = self.execute(step, *args, **kwargs)
        end.record()
        self.records.append((begin, end, step_class(step.num_tokens, step.num_seqs)))
        return out

    def summary(self) -> dict:
        """``{busy_ms, idle_ms, classes: {class: {steps, ms, ms_per_step}}}`` of the steps since
        the last call (idle: between one step's end and the next one's start)."""
        torch.cuda.synchronize()
        classes: dict[str, list] = defaultdict(lambda: [0, 0.0])
        idle, previous = 0.0, None
        for begin, end, kind in self.records:
            classes[kind][0] += 1
            classes[kind][1] += begin.elapsed_time(end)
            if previous is not None:
                idle += max(0.0, previous.elapsed_time(begin))
            previous = end
        self.records.clear()
        return {
            "busy_ms": sum(ms for _, ms in classes.values()),
            "idle_ms": idle,
            "classes": {
                k: {"steps": n, "ms": ms, "ms_per_step": ms / n}
                for k, (n, ms) in sorted(classes.items())
            },
        }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("artifact", help="the artifact directory (trtc build's output)")
    p.add_argument(
        "--budgets",
        default="",
        help="token budgets a step (max_num_batched_tokens), comma-separated; default: the "
        "artifact's limit",
    )
    p.add_argument("-n", "--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", default="128:1024", help="prompt tokens, MIN:MAX")
    p.add_argument("--output-len", default="32:512", help="output tokens, MIN:MAX")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the measurements here (JSON)")
    args = p.parse_args(argv)

    engine = LLMEngine(
        args.artifact,
        EngineConfig(executor="cuda", max_num_seqs=args.concurrency, enable_prefix_caching=False),
    )
    spec = dict(
        n=args.num_requests,
        prompt_len=_range(args.prompt_len, "--prompt-len"),  # `trtc bench`'s MIN:MAX
        output_len=_range(args.output_len, "--output-len"),
        seed=args.seed,
    )
    vocab, special = engine.manifest.model.vocab_size, set(engine.tokenizer.all_special_ids)
    requests = bench.request_set(spec, vocab, special, engine.tokenizer)
    budgets = [int(b) for b in args.budgets.split(",") if b] or [
        engine.scheduler.max_num_batched_tokens
    ]
    timer = StepTimer(engine.executor)
    report = []
    for budget in budgets:
        engine.scheduler.max_num_batched_tokens = budget
        # Warm-up: enough of the longest prompts for a first step of the whole budget (steps
        # longer than the largest prefill graph run eagerly, and an untuned artifact would
        # compile their kernels inside the timed run), then mixed steps; none of it timed.
        longest = spec["prompt_len"][1]
        warmup = bench.make_requests(
            min(args.concurrency, -(-budget // longest) + 1),
            (longest, longest),
            (2, 4),
            vocab,
            args.seed + 1,
            special,
        )
        bench.run_engine(engine, warmup, "inflight", args.concurrency)
        timer.summary()  # drops the warm-up's steps
        started = time.perf_counter()
        result = bench.run_engine(engine, requests, "inflight", args.concurrency)
        wall_ms = (time.perf_counter() - started) * 1e3
        steps = timer.summary()
        print(
            f"\nbudget {budget}: {result['output_tokens_per_s']:,.0f} output tok/s, TTFT p99 "
            f"{result['ttft_s']['p99'] * 1e3:,.0f} ms, TPOT p50 "
            f"{result['tpot_s']['p50'] * 1e3:.1f} ms; GPU busy {steps['busy_ms'] / 1e3:.2f} s of "
            f"{wall_ms / 1e3:.2f} s"
        )
        for kind, c in steps["classes"].items():
            print(
                f"  {kind:<24} {c['steps']:5d} steps x {c['ms_per_step']:7.2f} ms = "
                f"{c['ms'] / 1e3:6.2f} s"
            )
        report.append({"budget": budget, "wall_ms": wall_ms, "result": result, **steps})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)


if __name__ == "__main__":
    main()
