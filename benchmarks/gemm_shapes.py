"""The rate cuBLAS gives a model's dense projections at every token count a step can have, for
each way of asking it: the figures behind the choice of how a step's GEMMs are called (GPU
only).

    python3 benchmarks/gemm_shapes.py [--model 8b|1b] [--tokens 64:1024:64,1536,2048,4096]
        [--out gemm.json]

For each projection (qkv, o, gate_up, down of the Llama geometry) and each token count M:
``linear`` is ``F.linear(x, W)`` with W stored ``[out, in]`` as the executor holds it; ``lt`` is
the same call with cuBLASLt as torch's BLAS library; ``nn`` is ``x @ W_t`` with the weight
stored ``[in, out]``. A call's time is the median of CUDA-event timings of 20 back-to-back
calls (`timing.median_ms`), each reading a weight of tens to hundreds of MB (the 8B model's o
projection, 33.5 MB, fits an H100's L2, so part of its reads may hit there); TFLOP/s is 2 M N K
over it. The summary names, per projection, the token counts where a variant, or the same call
at a larger M (padding) or in two calls (a split at a multiple of 128), is at least 10% faster
than ``linear``.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import torch.nn.functional as F

from timing import median_ms

MODELS = {
    # name: (hidden, q + 2 kv width, intermediate)
    "8b": (4096, 4096 + 2 * 1024, 14336),
    "1b": (2048, 2048 + 2 * 256, 5632),
}


def parse_tokens(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        if part.count(":") == 2:
            lo, hi, step = (int(v) for v in part.split(":"))
            out.extend(range(lo, hi + 1, step))
        else:
            out.append(int(part))
    return sorted(set(out))


def time_call(fn, calls: int = 20) -> float:
    def burst():
        for _ in range(calls):
            fn()

    return median_ms(burst, reps=15, warmup=2) / calls


def time_projection(n: int, k: int, tokens: list[int]) -> dict[str, dict[int, float]]:
    """Milliseconds a call of each variant at each token count, for an ``[n, k]`` weight."""
    dev, dt = torch.device("cuda"), torch.float16
    w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
    wt = w.t().contiguous()
    x_all = torch.randn(max(tokens), k, device=dev, dtype=dt)
    rows: dict[str, dict[int, float]] = {"linear": {}, "lt": {}, "nn": {}}
    for m in tokens:
        x = x_all[:m]
        rows["linear"][m] = time_call(partial(F.linear, x, w))
        rows["nn"][m] = time_call(partial(torch.matmul, x, wt))
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            rows["lt"][m] = time_call(partial(F.linear, x, w))
        finally:
            torch.backends.cuda.preferred_blas_library("cublas")
        tf = {v: 2 * m * n * k / (rows[v][m] * 1e-3) / 1e12 for v in rows}
        cols = "  ".join(f"{v} {rows[v][m] * 1e3:8.1f} us {tf[v]:5.0f} TF" for v in rows)
        print(f"[{n}x{k}] M={m:5d} {cols}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="8b")
    ap.add_argument("--tokens", default="64:1024:64,1280,1536,2048,3072,4096")
    ap.add_argument("--out", default=None, help="write every figure here as JSON")
    args = ap.parse_args()
    hidden, qkv, inter = MODELS[args.model]
    shapes = {
        "qkv": (qkv, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }
    tokens = parse_tokens(args.tokens)
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, f"model {args.model}", flush=True)
    table = {name: time_projection(n, k, tokens) for name, (n, k) in shapes.items()}
    print("\nwhere another call is >= 10% faster than F.linear:")
    for name, rows in table.items():
        lin = rows["linear"]
        for m in tokens:
            best, how = lin[m], "linear"
            for v in ("lt", "nn"):
                if rows[v][m] < best:
                    best, how = rows[v][m], v
            for m2 in tokens:  # padding: the same call on more rows
                if m2 > m and lin[m2] < best:
                    best, how = lin[m2], f"pad to {m2}"
            for a in range(128, m, 128):  # two calls
                if a in lin and (m - a) in lin and lin[a] + lin[m - a] < best:
                    best, how = lin[a] + lin[m - a], f"split {a}+{m - a}"
            if best < 0.9 * lin[m]:
                print(
                    f"  {name:8s} M={m:5d}: {how:16s} {lin[m] * 1e3:7.1f} -> {best * 1e3:7.1f} us"
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "model": args.model, "ms": table},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
