"""How fast can a chain of kernels go that only *read* a weight of a given size? The ceiling
for any weight-streaming decode kernel (Int4Gemm, the dense GEMV) timed the way their
benchmarks time them: CUDA-graph replays of back-to-back launches over weight sets that do not
fit in L2, each launch reading a different set. Runs from the repository root (trtc installed):

    python3 benchmarks/read_ceiling.py [--out read_ceiling.json]

The kernel is a weight-streaming kernel with the arithmetic taken out: each program loads its
contiguous chunk of the weight (int32 words), before the programmatic-dependent-launch wait
where PDL is on (as `trtc.plugins.kernels.pdl` launches the decode kernels), XORs it and stores one
word. Sizes: the packed INT4 weights of the Int4Gemm benchmark's shapes ([4096, 4096],
[11008, 4096], [4096, 11008]: 8.4 / 22.5 / 22.5 MB) and the fp16 weights of [4096, 4096] and
[11008, 4096] (33.6 / 90.2 MB, the dense GEMV's). Each size is timed for chunks of 8-64 KB a program
and 4-16 warps, with and without PDL, with the loads evict-first, as TMA bulk loads, with an L2
prefetch of the next launch's weight, and as a plain device-to-device copy of the same bytes
(torch ``copy_``, bytes read only in the figure). Results: docs/gpu-kernels.md. The figure of
merit is bytes read per second over the bandwidth of a 4 GiB copy (bytes read + written), as in
the kernels' benchmarks (`timing.copy_bandwidth`, `timing.per_call_us`, `timing.ROTATION_BYTES`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from trtc.plugins.int4_gemm.triton_kernels import _PREFETCH_L2
from trtc.plugins.kernels import pdl

from timing import ROTATION_BYTES, copy_bandwidth, per_call_us

SIZES = {
    "int4 [4096, 4096]": 4096 * 4096 // 2,
    "int4 [11008, 4096]": 11008 * 4096 // 2,
    "fp16 [4096, 4096]": 4096 * 4096 * 2,
    "fp16 [11008, 4096]": 11008 * 4096 * 2,
}
CHUNKS = (2048, 4096, 8192, 16384)  # int32 words a program: 8, 16, 32, 64 KB
WARPS = (4, 8, 16)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _read_only(
    w_ptr,
    next_ptr,
    out_ptr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PREFETCH_NEXT: tl.constexpr,
    PIECES: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    if PREFETCH_NEXT:  # the next launch's weight into L2, one bulk prefetch a thread
        piece = tl.arange(0, PIECES)
        addr = (next_ptr + pid.to(tl.int64) * CHUNK + piece * (CHUNK // PIECES)).to(
            tl.int64, bitcast=True
        )
        tl.inline_asm_elementwise(
            _PREFETCH_L2,
            "=r,l,r",
            [addr, tl.full([PIECES], CHUNK // PIECES * 4, tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    # evict-first: streamed once, so L2 need not keep it
    words = tl.load(w_ptr + offs, eviction_policy="evict_first" if EVICT_FIRST else "")
    pdl.begin(PDL)
    tl.store(out_ptr + pid, tl.reduce(words, 0, _xor))


@triton.jit
def _read_only_tma(desc, out_ptr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """The same through the tensor memory accelerator: one bulk copy of ROWS x 256 words into
    shared memory a program."""
    pid = tl.program_id(0)
    words = desc.load([pid * ROWS, 0])
    pdl.begin(PDL)
    tl.store(out_ptr + pid, tl.reduce(tl.reduce(words, 1, _xor), 0, _xor))


def xor_of_chunks(words: torch.Tensor, chunk: int) -> torch.Tensor:
    """What `_read_only` stores for each program: the XOR of its ``chunk`` words."""
    rows = words.view(-1, chunk)
    acc = rows[:, 0].clone()
    for j in range(1, chunk):
        acc ^= rows[:, j]
    return acc


def read_calls(
    sets,
    out,
    chunk: int,
    warps: int,
    use_pdl: bool,
    evict_first: bool = False,
    prefetch_next: bool = False,
):
    """One launch a weight set; with ``prefetch_next`` each launch also asks L2 for the next
    set in the chain (the last for the first), one launch ahead of its reads."""
    grid = (sets[0].numel() // chunk,)
    opts = pdl.launch_options(sets[0].device, use_pdl)
    nxt = sets[1:] + sets[:1]
    return [
        lambda w=w, v=v: _read_only[grid](
            w,
            v,
            out,
            CHUNK=chunk,
            num_warps=warps,
            EVICT_FIRST=evict_first,
            PREFETCH_NEXT=prefetch_next,
            PIECES=32 * warps,
            **opts,
        )
        for w, v in zip(sets, nxt)
    ]


def tma_calls(sets, out, rows: int, warps: int, use_pdl: bool):
    from triton.tools.tensor_descriptor import TensorDescriptor

    descs = [TensorDescriptor.from_tensor(w.view(-1, 256), [rows, 256]) for w in sets]
    grid = (sets[0].numel() // (rows * 256),)
    opts = pdl.launch_options(sets[0].device, use_pdl)
    return [
        lambda d=d: _read_only_tma[grid](d, out, ROWS=rows, num_warps=warps, **opts) for d in descs
    ]


def weight_sets(nbytes: int) -> list[torch.Tensor]:
    """Random int32 weights of ``nbytes`` each, as many sets as `ROTATION_BYTES` needs (at least
    four), so that no launch of a chain finds its weight in L2."""
    count = max(4, math.ceil(ROTATION_BYTES / nbytes))
    return [
        torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), device="cuda", dtype=torch.int32)
        for _ in range(count)
    ]


def check_reads_every_word(sets, out) -> None:
    """Correctness first: the kernel must really read every word (its XOR per chunk)."""
    _read_only[(sets[0].numel() // CHUNKS[0],)](
        sets[0],
        sets[0],
        out,
        CHUNK=CHUNKS[0],
        num_warps=4,
        PDL=False,
        EVICT_FIRST=False,
        PREFETCH_NEXT=False,
        PIECES=128,
    )
    want = xor_of_chunks(sets[0], CHUNKS[0])
    assert torch.equal(out[: want.numel()], want), "read-only kernel XOR mismatch"


def variants(sets, out, dsts) -> list[tuple[str, list]]:
    """``(name, calls)`` of every variant timed on one size: chunks x warps with and without
    PDL, evict-first, the L2 prefetch of the next launch's weight, TMA, and the copy."""
    found = [
        (
            f"read {chunk * 4 // 1024} KB/program w{warps}" + (" pdl" if p else ""),
            read_calls(sets, out, chunk, warps, p),
        )
        for chunk in CHUNKS
        for warps in WARPS
        for p in (True, False)
    ]
    found += [
        (
            f"read {chunk * 4 // 1024} KB/program w{warps} pdl evict-first",
            read_calls(sets, out, chunk, warps, True, True),
        )
        for chunk in CHUNKS[1:3]
        for warps in WARPS
    ]
    found += [
        (
            f"read {chunk * 4 // 1024} KB/program w{warps} pdl, L2 prefetch of the next",
            read_calls(sets, out, chunk, warps, True, prefetch_next=True),
        )
        for chunk in CHUNKS
        for warps in WARPS
    ]
    found += [
        (f"tma {rows} x 1 KB/program w{warps} pdl", tma_calls(sets, out, rows, warps, True))
        for rows in (8, 16, 32)
        for warps in (1, 4)
    ]
    found.append(
        (
            "copy_ (reads + writes)",
            [lambda s=s, d=dsts[i % 2]: d.copy_(s) for i, s in enumerate(sets)],
        )
    )
    return found


def time_variants(name: str, nbytes: int, timed: list[tuple[str, list]], bw: float) -> list:
    """Each variant's time a call and its share of the copy bandwidth, printed as it comes;
    a variant Triton cannot compile here is named and left out."""
    rows = []
    for variant, calls in timed:
        try:
            us = per_call_us(calls)
        except Exception as e:  # a variant Triton cannot compile here
            print(f"{name:20s} {variant}: {type(e).__name__}: {str(e)[:200]}")
            continue
        frac = nbytes / (us * 1e-6) / bw
        rows.append(
            {
                "size": name,
                "bytes": nbytes,
                "variant": variant,
                "us": us,
                "fraction_of_copy_bw": frac,
            }
        )
        print(
            f"{name:20s} {nbytes / 1e6:6.1f} MB  {variant:28s} {us:8.2f} us  "
            f"{100 * frac:5.1f}% of copy bw (bytes read)",
            flush=True,
        )
    return rows


def print_best(name: str, nbytes: int, rows: list, bw: float) -> None:
    """The fastest read-only variant of one size, against the transfer alone."""
    best = min(
        (r for r in rows if r["size"] == name and r["variant"].startswith("read")),
        key=lambda r: r["us"],
    )
    print(
        f"{name:20s} best: {best['variant']} {best['us']:.2f} us = "
        f"{100 * best['fraction_of_copy_bw']:.1f}%; "
        f"the transfer alone {nbytes / bw * 1e6:.2f} us"
    )


def measure_size(name: str, nbytes: int, bw: float) -> list:
    """Every variant on weights of ``nbytes``, checked first; the memory given back after."""
    sets = weight_sets(nbytes)
    out = torch.empty(nbytes // 4 // min(CHUNKS), device="cuda", dtype=torch.int32)
    check_reads_every_word(sets, out)
    dsts = [torch.empty_like(s) for s in sets[:2]]
    rows = time_variants(name, nbytes, variants(sets, out, dsts), bw)
    print_best(name, nbytes, rows, bw)
    del sets, dsts
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="write every measurement here (JSON)")
    args = parser.parse_args()
    bw = copy_bandwidth()
    print(f"device copy bandwidth {bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
    rows = []
    for name, nbytes in SIZES.items():
        rows += measure_size(name, nbytes, bw)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "copy_bandwidth_TBps": bw / 1e12,
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
