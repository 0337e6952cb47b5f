"""Check and time the Triton PagedAttention kernels on a GPU against the torch reference and the
device's measured copy bandwidth. Runs from the repository root (trtc installed):

    python3 benchmarks/paged_attention.py [--out results.json]

Decode figure of merit: K/V bytes the step must read (each sequence's whole context, once) per
second, over the bandwidth of a large device-to-device copy measured in the same run
(`timing.copy_bandwidth`, 4 GiB). Times are medians of CUDA-graph replays, per call where
several calls are captured back to back (`timing.per_call_us`).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

from trtc.plugins.kernels import pdl
from trtc.plugins.paged_attention import triton_kernels
from trtc.plugins.paged_attention.reference import paged_attention as reference_attention

from timing import copy_bandwidth, per_call_us


def make_decode_step(batch, context, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = -(-(context + 1) // block_size)
    num_blocks = batch * blocks_per_seq + 1
    cache = torch.randn(
        2, num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g
    )
    perm = torch.randperm(num_blocks - 1, device="cuda", generator=g)[: batch * blocks_per_seq] + 1
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context + 1, dtype=torch.int32, device="cuda")
    slots = tables[:, context // block_size].long() * block_size + context % block_size
    q = torch.randn(batch, heads * head_dim, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(batch, kv_heads * head_dim, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(batch, kv_heads * head_dim, device="cuda", dtype=dtype, generator=g)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return (q, k, v, cache, slots, tables, lens, qsl)


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def graph_us(*calls) -> float:
    """Median microseconds per call of ``calls`` captured back to back in one CUDA graph (no
    launch gaps), as the CUDA executor runs them."""
    return per_call_us(calls, warmup=25, rep=100)


def ragged_error(case: list[tuple[int, int]], dtype) -> tuple[int, float]:
    """A mixed step of ``(cached, new)`` token counts a sequence, through the Triton kernel in
    ``dtype`` against the fp32 reference on the CPU: the step's tokens and the relative error."""
    torch.manual_seed(1)
    H, KV, D, BS = 32, 4, 64, 16
    n_blocks = sum(-(-(c + n) // BS) for c, n in case) + 4
    cache = torch.randn(2, n_blocks, BS, KV, D)
    perm = torch.randperm(n_blocks).tolist()
    tables, slots, starts, lens = [], [], [0], []
    for c, n in case:
        blocks = [perm.pop() for _ in range(-(-(c + n) // BS))]
        tables.append(blocks)
        slots += [blocks[p // BS] * BS + p % BS for p in range(c, c + n)]
        starts.append(starts[-1] + n)
        lens.append(c + n)
    width = max(map(len, tables))
    T = starts[-1]
    q, k, v = torch.randn(T, H * D), torch.randn(T, KV * D), torch.randn(T, KV * D)
    step = (
        torch.tensor(slots),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
    )
    kw = dict(num_heads=H, num_kv_heads=KV, head_dim=D, scale=D**-0.5)
    qd, kd, vd, cd = (x.to(dtype) for x in (q, k, v, cache))
    want, _ = reference_attention(
        qd.float(), kd.float(), vd.float(), cd.float().clone(), *step, **kw
    )
    got, got_cache = triton_kernels.paged_attention(
        qd.cuda(), kd.cuda(), vd.cuda(), cd.cuda(), *(x.cuda() for x in step), **kw
    )
    return T, rel_err(got.cpu(), want)


def check_correctness(results: dict) -> bool:
    """Correctness on a ragged mixed step, fp16 and bf16, against the fp32 reference on the
    CPU; False at the first case past the tolerance."""
    for dtype in (torch.float16, torch.bfloat16):
        for case in ([(2047, 1)] * 8 + [(0, 300), (500, 129), (17, 1)], [(100, 1)] * 64):
            T, err = ragged_error(case, dtype)
            results.setdefault("correctness", []).append(
                {"dtype": str(dtype), "tokens": T, "rel_err": err}
            )
            print(f"correctness {dtype} T={T}: rel err {err:.2e}")
            if not err < 1e-2:
                print("FAILED correctness")
                return False
    return True


def time_variants(attention, step, kv_bytes: int, bw: float) -> list[dict]:
    """The decode launch's tiles, splits, warps, stages and merges, attention only."""
    # Measured 2026-12-02/03 (docs/gpu-kernels.md): tile 32/64/128, 2/4/8 splits, warps 2/4/8,
    # stages 1/2/3, grid order, V loaded early, block ids loaded a tile ahead, and a kernel that
    # reads every KV head of a tile in one program: all 50.5-80 us, none better than the default.
    # Now: the splits merged by the last program to finish (merge="last", one launch) against the
    # merge kernel.
    variants = [dict(tile_k=64, splits=4, warps=2, stages=3, merge="kernel")]
    variants += [
        dict(tile_k=tile_k, splits=splits, warps=warps, stages=stages, merge="last")
        for tile_k in (32, 64)
        for splits in (4, 8, 16)
        for warps, stages in ((2, 3), (4, 2))
    ]
    rows = []
    for v in variants:
        call = partial(
            attention,
            *step,
            tile_k=v["tile_k"],
            num_splits=v["splits"],
            num_warps=v["warps"],
            num_stages=v["stages"],
            merge=v["merge"],
            write_kv=False,
        )
        try:
            us = graph_us(call)
        except Exception as e:  # e.g. out of shared memory for a tile/stage combination
            print(f"decode {v}: failed ({type(e).__name__}: {str(e)[:100]})")
            continue
        frac = kv_bytes / (us * 1e-6) / bw
        rows.append(dict(v, write_kv=False, us=us, fraction_of_copy_bw=frac))
        print(f"decode (attention only) {v}: {us:7.1f} us  {frac * 100:5.1f}% of copy bandwidth")
    return rows


def time_best(attention, step, best: dict, kv_bytes: int, bw: float, results: dict) -> None:
    """The best variant with the plugin's own cache-write kernel (the unfused graph), and one
    FP8-cache run of it."""
    opts = dict(
        tile_k=best["tile_k"],
        num_warps=best["warps"],
        num_stages=best["stages"],
        merge=best["merge"],
    )
    us = graph_us(partial(attention, *step, num_splits=best["splits"], **opts))
    results["decode_with_write"] = {"us": us, "fraction_of_copy_bw": kv_bytes / (us * 1e-6) / bw}
    print(f"best with the write kernel: {us:.1f} us, {kv_bytes / (us * 1e-6) / bw * 100:.1f}%")
    q, k, v, cache, slots, tables, lens, qsl = step
    fp8_step = (q, k, v, cache.to(torch.float8_e4m3fn), slots, tables, lens, qsl)
    us = graph_us(
        partial(attention, *fp8_step, num_splits=best["splits"], k_scale=0.02, v_scale=0.02, **opts)
    )
    fp8_fraction = kv_bytes / 2 / (us * 1e-6) / bw
    results["decode_fp8_cache"] = {"us": us, "fraction_of_copy_bw": fp8_fraction}
    print(f"best on an FP8 cache (half the bytes): {us:.1f} us, {fp8_fraction * 100:.1f}%")


def time_back_to_back(attention, layers, kv_bytes: int, bw: float, results: dict) -> None:
    """Back to back, as a decode step runs them (one launch per layer): the layers' caches, the
    calls captured in one graph, with and without programmatic dependent launch (the next
    launch overlaps the previous one's tail; trtc.plugins.kernels.pdl)."""
    for on in (True, False):
        was = pdl.set_enabled(on)
        us = graph_us(*(partial(attention, *s, write_kv=False) for s in layers))
        pdl.set_enabled(was)
        results[f"decode_back_to_back_{'pdl' if on else 'no_pdl'}"] = {
            "us_per_call": us,
            "fraction_of_copy_bw": kv_bytes / (us * 1e-6) / bw,
        }
        print(
            f"decode default plan, {len(layers)} layers back to back, PDL {'on' if on else 'off'}: "
            f"{us:.1f} us a call, {kv_bytes / (us * 1e-6) / bw * 100:.1f}% of copy bandwidth"
        )


def time_batch1(attention, geometry: tuple[int, int, int, int], results: dict) -> None:
    """Batch 1 (a single request's decode), 8 layers back to back with PDL: the splits merged by
    the combine kernel or by the last split, at a short and a long context."""
    H, KV, D, BS = geometry
    results["batch1"] = []
    for ctx in (256, 2048):
        one = [make_decode_step(1, ctx, H, KV, D, BS, torch.float16, seed=s) for s in range(8)]
        for splits, merge in (
            (16, "kernel"),
            (16, "last"),
            (8, "last"),
            (8, "kernel"),
            (4, "last"),
        ):
            us = graph_us(
                *(
                    partial(attention, *s, write_kv=False, num_splits=splits, merge=merge)
                    for s in one
                )
            )
            results["batch1"].append(
                {"context": ctx, "splits": splits, "merge": merge, "us_per_call": us}
            )
            print(
                f"decode batch 1, context {ctx}, {splits} splits, merge {merge}: {us:.2f} us a call"
            )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="write every measurement here (JSON)")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    bw = copy_bandwidth()
    results["copy_bandwidth_TBps"] = bw / 1e12
    print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s")
    if not check_correctness(results):
        return 1

    # Decode bandwidth: batch 64, context 2048, 1.1B geometry (32 query heads, 4 KV heads, D 64).
    batch, context, H, KV, D, BS = 64, 2048, 32, 4, 64, 16
    step = make_decode_step(batch, context, H, KV, D, BS, torch.float16)
    kv_bytes = 2 * batch * (context + 1) * KV * D * 2
    kw = dict(num_heads=H, num_kv_heads=KV, head_dim=D, scale=D**-0.5)
    attention = partial(triton_kernels.paged_attention, **kw)
    rows = time_variants(attention, step, kv_bytes, bw)
    best = max(rows, key=lambda r: r["fraction_of_copy_bw"])
    print(f"best: {best}")
    time_best(attention, step, best, kv_bytes, bw, results)
    results["decode"] = rows
    auto = triton_kernels.plan(batch, batch, H, KV, D)
    us = graph_us(partial(attention, *step, write_kv=False))
    results["decode_default"] = {
        "plan": auto,
        "us": us,
        "fraction_of_copy_bw": kv_bytes / (us * 1e-6) / bw,
    }
    print(
        f"decode default plan {auto} (attention only): {us:.1f} us, "
        f"{kv_bytes / (us * 1e-6) / bw * 100:.1f}% of copy bandwidth"
    )
    layers = [step] + [
        make_decode_step(batch, context, H, KV, D, BS, torch.float16, seed=s) for s in range(1, 8)
    ]
    time_back_to_back(attention, layers, kv_bytes, bw, results)
    time_batch1(attention, (H, KV, D, BS), results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
