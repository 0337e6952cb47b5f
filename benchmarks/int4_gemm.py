"""Check and time the Triton Int4Gemm kernels on a GPU, in one call, against the torch reference,
torch's fp16 matmul of the same shape and the device's measured copy bandwidth. Runs from the
repository root (trtc importable):

    python3 benchmarks/int4_gemm.py [--out int4.json] [--decode-only | --prefill-only]
        [--no-split-variants] [--budget SECONDS]

Shapes ``[N, K]``: the Llama-7B projections [4096, 4096] (q/k/v/o), [11008, 4096] (up/gate) and
[4096, 11008] (down); group size 128, fp16, no bias.

* Decode, 1/2/4/8/16 tokens: figure of merit = packed-weight bytes (N * K / 2) per second, over
  the bandwidth of a large device-to-device copy measured in the same run (bytes read + written).
  Scales and zeros add 3/64 of that (in ``all_bytes_fraction`` with x and y, not in the figure).
  After the plugin-layout kernels' plans, the fragment kernel's (`fragment_kernel.py`, on the
  same weight sets in its layout; ``*`` in its summary marks `fragment_plan`'s choice, what the
  CUDA executor runs).
* Prefill, 256 and 1024 tokens: TFLOP/s (2 T N K per call) against torch fp16 matmul.

Every variant is checked against the fp32 reference before it is timed. Times are medians of
CUDA-graph replays (``triton.testing.do_bench``), each graph calling the kernel once on each of
R weight sets (R sets >= 200 MB, four times the 50 MB L2, so no call finds its weight in L2),
divided by R: back-to-back launches as a captured decode step runs them (`timing.per_call_us`,
`timing.ROTATION_BYTES`). The copy bandwidth: `timing.copy_bandwidth` (4 GiB).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from trtc.plugins.int4_gemm import fragment_kernel, triton_kernels
from trtc.plugins.int4_gemm.reference import dequantize
from trtc.plugins.int4_gemm.triton_kernels import Plan
from trtc.plugins.kernels import pdl

from timing import ROTATION_BYTES, copy_bandwidth, per_call_us

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]
DECODE_TOKENS = [1, 2, 4, 8, 16]
PREFILL_TOKENS = [256, 1024]
GROUP = 128
TIME_BUDGET_S = 80.0  # default --budget: stop timing new variants past this
DEVICE = "cuda"


def random_layer(n: int, k: int, seed: int, dtype=torch.float16):
    """Random packed int4 weight (every byte value), scales 0.001..0.021, zeros 0..15."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    groups = -(-k // GROUP)
    qweight = torch.randint(0, 256, (n, k // 2), generator=g, device=DEVICE, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g, device=DEVICE) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, groups), generator=g, device=DEVICE, dtype=torch.uint8)
    return qweight, scales, zeros


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def plan_name(plan) -> str:
    if plan is None:
        return "default"
    if plan.kernel != "split":
        text = f"{plan.kernel} n{plan.block_n} k{plan.block_k} w{plan.num_warps}"
        text += " half2" if plan.half2 else ""
        text += " ef" if plan.evict_first else ""
        return text + (f" r{plan.max_registers}" if plan.max_registers else "")
    text = f"t{plan.block_t} n{plan.block_n} k{plan.block_k} s{plan.split_k}"
    if plan.split_k > 1:
        text += f" {plan.reduce}"
    text += f" w{plan.num_warps} st{plan.num_stages}"
    text += " pf" if plan.prefetch else ""
    text += " ef" if plan.evict_first else ""
    return text + (f" r{plan.max_registers}" if plan.max_registers else "")


def split_variants(tokens: int, n: int, k: int, sms: int) -> list:
    """The split-K dot kernel's decode plan, the same with the L2 prefetch and with evict-first
    weight loads, and the alternatives around them: who adds the partial sums, pipeline depth,
    128-row programs (two warpgroups, registers capped for two programs an SM), 128-column
    steps (64 bytes of a row, one group at a time)."""
    plan = triton_kernels.split_plan(tokens, n, k, GROUP, sms)
    bk, split = plan.block_k, plan.split_k

    def splits(block_n, block_k, slots):
        return triton_kernels.split_k_for(-(-n // block_n), -(-k // block_k), slots, tokens, k)

    def prefetched(p):
        return Plan(**{**p.__dict__, "prefetch": True})

    alternatives = [
        Plan(16, 64, split, "kernel", 4, 3, bk),
        Plan(16, 64, split, "last", 4, 4, bk),
        Plan(16, 128, splits(128, bk, 2 * sms), "last", 8, 3, bk, 128),
        Plan(16, 64, splits(64, 128, 3 * sms), "last", 4, 3, 128),
    ]
    # The same with the L2 prefetch of each program's weight slice (`Plan.prefetch`), and
    # what it may change: fewer splits (a longer loop over data already in L2), more stages.
    fewer = Plan(16, 64, max(1, split // 2), "last", 4, 3, bk, prefetch=True)
    # And with the packed weight loaded evict-first (`Plan.evict_first`), with the plan's own
    # prefetch setting and the other one.
    evicting = Plan(**{**plan.__dict__, "evict_first": True})
    flipped = Plan(**{**evicting.__dict__, "prefetch": not plan.prefetch})
    return (
        [plan, prefetched(plan), evicting, flipped, fewer]
        + [prefetched(p) for p in alternatives[1:3]]
        + alternatives
    )


# The weights-first kernel's variants per token count, most promising first: (rows per
# program, warps, columns per step (None: the whole row, loaded before the wait), register cap,
# half2 products). At 4 and 8 tokens its fp32 path took 1.6-5.9x the split-K kernel's time
# (first call of 2026-12-03, third session), and its tl.dot variant 3.6-5.1x at every token
# count (removed).
ROWS_VARIANTS = {
    1: [
        (8, 4, None, None, True),
        (8, 8, None, None, True),
        (4, 4, None, None, True),
        (16, 8, None, None, True),
        (16, 4, None, None, True),
        (8, 8, None, None, False),
        (8, 4, None, None, False),
        (4, 4, None, None, False),
    ],
    2: [
        (4, 4, None, None, True),
        (4, 4, 2048, None, True),
        (8, 4, None, None, True),
        (8, 8, None, None, True),
        (2, 4, None, None, True),
        (4, 4, None, None, False),
        (4, 4, 2048, None, False),
    ],
    4: [
        (4, 4, None, None, True),
        (4, 8, None, None, True),
        (8, 8, None, None, True),
        (2, 4, None, None, True),
    ],
}


def rows_variants(tokens: int, k: int) -> list:
    """The variants of `ROWS_VARIANTS`, and the first two of them again with the packed weight
    loaded evict-first (`Plan.evict_first`)."""
    whole = 1 << (k - 1).bit_length()
    plans = [
        Plan(
            16,
            rows,
            kernel="rows",
            num_warps=warps,
            num_stages=1,
            block_k=bk or whole,
            max_registers=regs,
            half2=half2,
        )
        for rows, warps, bk, regs, half2 in ROWS_VARIANTS.get(tokens, [])
    ]
    flipped = [Plan(**{**p.__dict__, "evict_first": not p.evict_first}) for p in plans[:2]]
    return plans[:2] + flipped + plans[2:]


def decode_variants(tokens: int, n: int, k: int, sms: int, split_alternatives: bool = True) -> list:
    """The default plan (``None``), the split-K kernel's plan (the default before the
    weights-first kernel) and its alternatives, the weights-first kernel's variants."""
    default = triton_kernels.default_plan(tokens, n, k, GROUP, sms)
    plans = split_variants(tokens, n, k, sms)
    plans = (plans if split_alternatives else plans[:4]) + rows_variants(tokens, k)
    unique = []
    for plan in plans:
        if plan.split_k == 1 and plan.reduce == "last":
            plan = Plan(**{**plan.__dict__, "reduce": "kernel"})  # nothing to reduce
        if plan != default and plan not in unique:
            unique.append(plan)
    return [None] + unique


def fragment_variants(tokens: int, n: int, k: int) -> list:
    """The fragment kernel's plan (`fragment_kernel.fragment_plan`: what the CUDA executor
    runs), the other warp counts, two tiles a program and evict-first words: those whose lanes
    hold at most `fragment_kernel.LANE_STEPS` steps; none where the kernel takes no launch of
    this many tokens."""
    base = fragment_kernel.fragment_plan(tokens, n, k, GROUP)
    if base is None:
        return []
    limit = fragment_kernel.LANE_STEPS
    plans = [base] + [fragment_kernel.FragmentPlan(1, w) for w in (4, 8, 16)]
    plans += [
        fragment_kernel.FragmentPlan(2, base.warps_k),
        fragment_kernel.FragmentPlan(base.tiles, base.warps_k, evict_first=True),
    ]
    unique = []
    for plan in plans:
        steps = fragment_kernel.lane_steps(k, GROUP, plan.warps_k)
        if plan not in unique and (steps <= limit or plan == base):
            unique.append(plan)
    return unique


def fragment_name(plan) -> str:
    return f"fragment t{plan.tiles} w{plan.warps_k}" + (" ef" if plan.evict_first else "")


def prefill_variants() -> list:
    return [None, Plan(128, 128, num_warps=8, num_stages=3, block_k=128)]


def time_variant(
    rows, failures, deadline, where, name, call, calls, want, fp16_us, bw, meta_bytes, **extra
):
    """Check ``call()`` against ``want``, then time ``calls`` (the same on every weight set):
    appends the row (``extra`` merged in) and prints it. None, and a failure or a skipped row,
    when it does not compile, is wrong, or the time budget is spent. ``meta_bytes``: bytes of
    scales, zeros (or records) per row and group, for ``all_bytes_fraction``."""
    n, k, tokens = where["n"], where["k"], where["tokens"]
    if time.monotonic() > deadline:
        rows.append({**where, "variant": name, "skipped": "time budget"})
        return None
    try:
        err = rel_err(call(), want)
    except Exception as e:  # a variant that does not compile
        failures.append(f"{n}x{k} T={tokens} {name}: {type(e).__name__}: {e}"[:300])
        return None
    if not err < 2e-3:
        failures.append(f"{n}x{k} T={tokens} {name}: relative error {err:.2e}")
        return None
    us = per_call_us(calls)
    packed = n * k // 2
    row = {
        **where,
        "variant": name,
        "rel_err": err,
        "us": us,
        "speedup_vs_fp16": fp16_us / us,
        "tflops": 2 * tokens * n * k / (us * 1e-6) / 1e12,
        "packed_GBps": packed / (us * 1e-6) / 1e9,
        "fraction_of_copy_bw": packed / (us * 1e-6) / bw,
        "all_bytes_fraction": (packed + meta_bytes * n * (-(-k // GROUP)) + 2 * tokens * (k + n))
        / (us * 1e-6)
        / bw,
        **extra,
    }
    rows.append(row)
    print(
        f"{n:5d}x{k:<5d} T={tokens:4d} {name:38s} {us:8.2f} us  err {err:.1e}  "
        + (
            f"{row['fraction_of_copy_bw'] * 100:5.1f}% copy bw"
            if tokens <= 16
            else f"{row['tflops']:6.1f} TFLOP/s"
        )
        + f"  x{row['speedup_vs_fp16']:.2f} vs fp16",
        flush=True,
    )
    return row


def weight_sets(n: int, k: int):
    """The packed weight sets of one shape (as many as `ROTATION_BYTES` needs, at least four),
    the first one dequantized (fp32, the reference) and fp16 weights of the shape for torch's
    matmul, the first being that reference."""
    packed = n * k // 2
    sets = [random_layer(n, k, seed) for seed in range(max(4, math.ceil(ROTATION_BYTES / packed)))]
    w_ref = dequantize(*sets[0], GROUP)  # fp32 [N, K]
    dense = [w_ref.half()] + [
        torch.randn(n, k, device=DEVICE, dtype=torch.float16) * 0.02
        for _ in range(max(2, math.ceil(ROTATION_BYTES / (2 * n * k))) - 1)
    ]
    return sets, w_ref, dense


def time_fp16(rows, base: dict, x, dense, bw: float) -> float:
    """torch's fp16 matmul of the shape (the row), its microseconds a call."""
    n, k, tokens = base["n"], base["k"], base["tokens"]
    fp16_us = per_call_us([partial(F.linear, x, w) for w in dense])
    rows.append(
        {
            **base,
            "variant": "torch fp16 matmul",
            "us": fp16_us,
            "tflops": 2 * tokens * n * k / (fp16_us * 1e-6) / 1e12,
            "fraction_of_copy_bw": 2 * n * k / (fp16_us * 1e-6) / bw,
        }
    )
    return fp16_us


def time_plugin_plans(record, x, sets, want, fp16_us, bw, sms, split_alternatives):
    """The plugin-layout kernels' plans (decode or prefill variants); the default plan's calls,
    when it was timed."""
    n, k, tokens = record[3]["n"], record[3]["k"], record[3]["tokens"]
    kw = dict(group_size=GROUP, in_features=k, out_features=n)
    default_calls = None
    for plan in (
        decode_variants(tokens, n, k, sms, split_alternatives)
        if tokens <= 16
        else prefill_variants()
    ):
        chosen = plan or triton_kernels.default_plan(tokens, n, k, GROUP, sms)
        calls = [partial(triton_kernels.int4_gemm, x, *s, plan=plan, **kw) for s in sets]
        # split_plan: the split-K kernel's own plan, the default before the weights-first one.
        row = time_variant(
            *record,
            plan_name(plan),
            calls[0],
            calls,
            want,
            fp16_us,
            bw,
            3,
            plan=chosen.__dict__,
            split_plan=chosen == triton_kernels.split_plan(tokens, n, k, GROUP, sms),
        )
        if row is not None and plan is None:
            default_calls = calls
    return default_calls


def time_fragment_plans(record, x, fsets, want, fp16_us, bw) -> None:
    """The fragment kernel's decode variants, or for prefill what the executor runs on the
    fragment layout (dequantize + cuBLAS)."""
    n, k, tokens = record[3]["n"], record[3]["k"], record[3]["tokens"]
    decode = tokens <= 16
    for plan in fragment_variants(tokens, n, k) if decode else []:
        calls = [partial(fragment_kernel.int4_gemm_fragment, x, f, plan=plan) for f in fsets]
        time_variant(
            *record,
            fragment_name(plan),
            calls[0],
            calls,
            want,
            fp16_us,
            bw,
            4,
            plan=plan.__dict__,
            fragment=True,
            chosen=plan == fragment_kernel.fragment_plan(tokens, n, k, GROUP),
        )
    if not decode:  # what the executor runs for prefill on the fragment layout
        calls = [partial(fragment_kernel.fragment_matmul, x, f) for f in fsets]
        time_variant(
            *record,
            "fragment: dequantize + cuBLAS",
            calls[0],
            calls,
            want,
            fp16_us,
            bw,
            4,
            fragment=True,
            chosen=True,
        )


def time_default_again(rows, base: dict, default_calls, bw: float) -> None:
    """The default plan once more, last: the spread between its two times is the noise. And
    without programmatic dependent launch (trtc.plugins.kernels.pdl): what the overlap of one
    call's start with the previous call's tail is worth."""
    packed = base["n"] * base["k"] // 2
    rows.append({**base, "variant": "default (again)", "us": per_call_us(default_calls)})
    was = pdl.set_enabled(False)
    us = per_call_us(default_calls)
    pdl.set_enabled(was)
    rows.append(
        {
            **base,
            "variant": "default, no PDL",
            "us": us,
            "fraction_of_copy_bw": packed / (us * 1e-6) / bw,
        }
    )


def bench_shape(n, k, sms, bw, deadline, rows, failures, token_counts, split_alternatives=True):
    sets, w_ref, dense = weight_sets(n, k)
    fsets = None  # the weight sets in the fragment layout, when timed
    for tokens in token_counts:
        x = torch.randn(tokens, k, device=DEVICE, dtype=torch.float16)
        want = x.float() @ w_ref.T
        base = {"n": n, "k": k, "tokens": tokens}
        fp16_us = time_fp16(rows, base, x, dense, bw)
        record = (rows, failures, deadline, base)
        default_calls = time_plugin_plans(
            record, x, sets, want, fp16_us, bw, sms, split_alternatives
        )
        if not fragment_kernel.fragment_supports(n, k, GROUP):
            if fsets is None:
                fsets = [fragment_kernel.fragment_pack(*s, GROUP) for s in sets]
            time_fragment_plans(record, x, fsets, want, fp16_us, bw)
        if default_calls is not None:
            time_default_again(rows, base, default_calls, bw)


def check_bf16(failures) -> list:
    """bf16 activations and scales through the default plans (both kernels, a partial group)
    and the weights-first kernel's variants."""
    out = []
    cases = [(1, 4096, None), (4, 4096, None), (300, 4096 + 64, None)]
    cases += [
        (t, k, plan)
        for t in (1, 2)
        for k in (4096, 4096 + 64, 11008)
        for plan in rows_variants(t, k)[:1] + rows_variants(t, k)[-1:]
    ]
    for tokens, k, plan in cases:
        qweight, scales, zeros = random_layer(4096, k, 99, torch.bfloat16)
        x = torch.randn(tokens, k, device=DEVICE, dtype=torch.bfloat16)
        want = x.float() @ dequantize(qweight, scales, zeros, GROUP).T
        name = plan_name(plan)
        try:
            got = triton_kernels.int4_gemm(
                x,
                qweight,
                scales,
                zeros,
                group_size=GROUP,
                in_features=k,
                out_features=4096,
                plan=plan,
            )
        except Exception as e:
            failures.append(f"bf16 T={tokens} K={k} {name}: {type(e).__name__}: {e}"[:300])
            continue
        err = rel_err(got, want)
        out.append({"tokens": tokens, "k": k, "variant": name, "rel_err": err})
        print(f"bf16 T={tokens} K={k} {name}: relative error {err:.2e}")
        if not err < 1e-2:
            failures.append(f"bf16 T={tokens} K={k} {name}: relative error {err:.2e}")
    return out


def summary(rows, bw):
    """Per shape and token count: the default plan, the best variant, the split-K kernel's plan
    (the default before the weights-first kernel), torch fp16."""
    print(
        f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; packed-weight GB/s and % of copy bandwidth "
        f"(decode), TFLOP/s (prefill); xfp16 = fp16 matmul time / int4 time, xsplit = split-K "
        f"kernel time / int4 time"
    )
    print(
        f"{'shape':>11} {'T':>5} | {'default us':>10} {'%bw/TF':>7} {'xfp16':>6} {'xsplit':>6} | "
        f"{'best variant':30} {'us':>8} {'GB/s':>6} {'%bw/TF':>7} {'xfp16':>6} | "
        f"{'split us':>8} {'fp16 us':>8}"
    )
    keys = sorted(
        {(r["n"], r["k"], r["tokens"]) for r in rows},
        key=lambda t: (SHAPES.index((t[0], t[1])), t[2]),
    )
    for n, k, tokens in keys:
        group = [r for r in rows if (r["n"], r["k"], r["tokens"]) == (n, k, tokens) and "us" in r]
        fp16 = next((r for r in group if r["variant"] == "torch fp16 matmul"), None)
        again = next((r for r in group if r["variant"] == "default (again)"), None)
        no_pdl = next((r for r in group if r["variant"] == "default, no PDL"), None)
        ours = [
            r
            for r in group
            if r["variant"] not in ("torch fp16 matmul", "default (again)", "default, no PDL")
            and not r.get("fragment")
        ]
        if not ours or fp16 is None:
            continue
        best = min(ours, key=lambda r: r["us"])
        default = next((r for r in ours if r["variant"] == "default"), best)
        split = next((r for r in ours if r.get("split_plan")), default)

        def merit(r, tokens=tokens):
            return (
                f"{r['fraction_of_copy_bw'] * 100:6.1f}%" if tokens <= 16 else f"{r['tflops']:7.1f}"
            )

        print(
            f"{n:5d}x{k:<5d} {tokens:5d} | {default['us']:10.2f} {merit(default)} "
            f"{default['speedup_vs_fp16']:6.2f} {split['us'] / default['us']:6.2f} | "
            f"{best['variant']:30} {best['us']:8.2f} {best['packed_GBps']:6.0f} {merit(best)} "
            f"{best['speedup_vs_fp16']:6.2f} | {split['us']:8.2f} {fp16['us']:8.2f}"
            + (f"  (default again {again['us']:.2f})" if again else "")
            + (f"  (no PDL {no_pdl['us']:.2f})" if no_pdl else "")
        )
    frag = [r for r in rows if r.get("fragment") and "us" in r]
    if not frag:
        return
    print(
        "\nfragment kernel (plugins/int4_gemm/fragment_kernel.py; * = fragment_plan's choice, "
        "what the CUDA executor runs): time, % of copy bandwidth, default-plan time / its time"
    )
    for n, k, tokens in keys:
        group = [r for r in frag if (r["n"], r["k"], r["tokens"]) == (n, k, tokens)]
        default = next(
            (
                r
                for r in rows
                if (r["n"], r["k"], r["tokens"]) == (n, k, tokens)
                and r["variant"] == "default"
                and "us" in r
            ),
            None,
        )
        if not group or default is None:
            continue
        cells = "  ".join(
            f"{'*' if r['chosen'] else ' '}{r['variant'][9:]} {r['us']:.2f} us "
            f"{r['fraction_of_copy_bw'] * 100:.1f}% x{default['us'] / r['us']:.2f}"
            for r in group
        )
        print(f"{n:5d}x{k:<5d} {tokens:3d} | default {default['us']:.2f} us | {cells}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="write every measurement here (JSON)")
    parser.add_argument("--decode-only", action="store_true", help="no prefill shapes")
    parser.add_argument("--prefill-only", action="store_true", help="no decode shapes")
    parser.add_argument(
        "--no-split-variants",
        action="store_true",
        help="time the split-K kernel's decode plan (with and without the prefetch "
        "and evict-first loads) only, not its alternatives",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=TIME_BUDGET_S,
        help="seconds for the timings, shared equally by the shapes (variants "
        "past a shape's share are skipped)",
    )
    args = parser.parse_args()
    if args.decode_only and args.prefill_only:
        parser.error("--decode-only and --prefill-only leave nothing to time")
    start = time.monotonic()
    props = torch.cuda.get_device_properties(0)
    results = {
        "device": torch.cuda.get_device_name(),
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "group_size": GROUP,
    }
    bw = copy_bandwidth()
    results["copy_bandwidth_TBps"] = bw / 1e12
    print(
        f"device copy bandwidth: {bw / 1e12:.2f} TB/s ({results['device']}, {results['sms']} SMs)"
    )
    rows, failures = [], []
    results["bf16_checks"] = check_bf16(failures)
    token_sets = ([] if args.prefill_only else [DECODE_TOKENS]) + (
        [] if args.decode_only else [PREFILL_TOKENS]
    )
    jobs = [(tokens, n, k) for tokens in token_sets for n, k in SHAPES]
    end = start + args.budget
    for i, (token_counts, n, k) in enumerate(jobs):
        deadline = time.monotonic() + (end - time.monotonic()) / (len(jobs) - i)
        bench_shape(
            n,
            k,
            props.multi_processor_count,
            bw,
            deadline,
            rows,
            failures,
            token_counts,
            split_alternatives=not args.no_split_variants,
        )
        torch.cuda.empty_cache()
    results["rows"] = rows
    results["failures"] = failures
    results["seconds"] = time.monotonic() - start
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    for f in failures:
        print(f"FAILED {f}")
    summary(rows, bw)
    print(
        f"({results['seconds']:.0f} s; {sum('skipped' in r for r in rows)} variants skipped "
        f"for time, {len(failures)} failed)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
