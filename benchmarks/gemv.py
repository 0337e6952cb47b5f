"""Check and time the dense GEMV (`plugins/kernels/gemv.py`) against cuBLAS (``F.linear``) on the
projections of the 1.1B Llama geometry (hidden 2048, 32 + 2 x 4 heads of 64, MLP 5632, vocab
32000), fp16, in the form a decode step runs them: a chain of 22 layers x (qkv, o, gate_up,
down), each projection's input a slice of the previous one's output, captured in one CUDA graph.

    python3 benchmarks/gemv.py [--tokens 1,2] [--out gemv.json]

Variants: cuBLAS; the GEMV with and without programmatic dependent launch; other warp counts and
tile heights; SwiGLU as the gate_up GEMV's epilogue instead of its own kernel.
The figure of merit is the chain's weight bytes per second over a large copy's bandwidth
(`timing.copy_bandwidth`, 4 GiB); a chain's time is the median replay of its CUDA graph
(`timing.per_call_us`).
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import torch.nn.functional as F
import triton

from trtc.plugins.kernels import gemv, pointwise

from timing import copy_bandwidth, per_call_us

HIDDEN, QKV, MLP, VOCAB, LAYERS = 2048, 2048 + 2 * 256, 5632, 32000, 22


def layer_weights(dtype) -> list[torch.Tensor]:
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)]
    return [torch.randn(s, device="cuda", dtype=dtype) * 0.02 for s in shapes]


def chain(linear, x, layers, swiglu_in_gemv=False):
    """One decode step's projections: each input a slice of the previous output, SwiGLU between
    gate_up and down (its Triton kernel, or the gate_up GEMV's epilogue)."""
    h = x
    for qkv, o, gate_up, down in layers:
        a = linear(h, qkv)
        b = linear(a[:, :HIDDEN], o)
        if swiglu_in_gemv:
            c = gemv.gemv(b, gate_up, swiglu=True)
        else:
            c = pointwise.swiglu(linear(b, gate_up))
        h = linear(c, down)
    return h


def check(dtype, tokens, failures) -> list[dict]:
    """Every projection shape (and the LM head, a bias) against the fp32 product."""
    out = []
    for n, k in [
        (QKV, HIDDEN),
        (HIDDEN, HIDDEN),
        (2 * MLP, HIDDEN),
        (HIDDEN, MLP),
        (VOCAB, HIDDEN),
        (1000, 576),
    ]:
        w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        bias = torch.randn(n, device="cuda", dtype=dtype) if n == 1000 else None
        x = torch.randn(tokens, k, device="cuda", dtype=dtype)
        want = x.float() @ w.float().T + (bias.float() if bias is not None else 0)
        for use_pdl in (False, True):
            got = gemv.gemv(x, w, bias, use_pdl=use_pdl)
            err = float((got.float() - want).norm() / want.norm())
            out.append(
                {
                    "dtype": str(dtype),
                    "tokens": tokens,
                    "n": n,
                    "k": k,
                    "pdl": use_pdl,
                    "rel_err": err,
                }
            )
            if not err < (2e-3 if dtype == torch.float16 else 1e-2):
                failures.append(
                    f"{dtype} T={tokens} {n}x{k} pdl={use_pdl}: relative error {err:.2e}"
                )
    return out


@torch.inference_mode()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", default="1,2", help="token counts, comma-separated (default 1,2)")
    p.add_argument("--out", default=None, help="write every measurement here (JSON)")
    args = p.parse_args(argv)
    tokens_list = [int(t) for t in args.tokens.split(",")]
    failures: list[str] = []
    report = {"device": torch.cuda.get_device_name(), "checks": [], "chains": []}
    for dtype in (torch.float16, torch.bfloat16):
        for t in tokens_list:
            report["checks"] += check(dtype, t, failures)
    bw = copy_bandwidth()
    report["copy_bandwidth"] = bw
    layers = [layer_weights(torch.float16) for _ in range(LAYERS)]
    chain_bytes = sum(w.numel() * 2 for layer in layers for w in layer)
    print(
        f"copy bandwidth {bw / 1e12:.2f} TB/s; chain of {LAYERS} layers, "
        f"{chain_bytes / 1e9:.2f} GB of weights (floor {chain_bytes / bw * 1e6:.0f} us)"
    )
    variants = {
        "cublas": lambda x, w: F.linear(x, w),
        "gemv": lambda x, w: gemv.gemv(x, w, use_pdl=False),
        "gemv+pdl": lambda x, w: gemv.gemv(x, w, use_pdl=True),
        "gemv+pdl 4 warps": lambda x, w: gemv.gemv(x, w, use_pdl=True, num_warps=4),
        "gemv+pdl 8 warps": lambda x, w: gemv.gemv(x, w, use_pdl=True, num_warps=8),
        "gemv+pdl half tile": lambda x, w: gemv.gemv(
            x, w, use_pdl=True, rows=max(1, gemv.TILE // 2 // triton.next_power_of_2(x.shape[1]))
        ),
    }
    for t in tokens_list:
        x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.float16)
        want = chain(variants["cublas"], x, layers[:2]).float()
        runs = [(name, linear, False) for name, linear in variants.items()]
        runs.append(("gemv+pdl, SwiGLU in the gate_up GEMV", variants["gemv+pdl"], True))
        for name, linear, fused in runs:
            got = chain(linear, x, layers[:2], fused).float()
            err = float((got - want).norm() / want.norm())
            us = per_call_us([partial(chain, linear, x, layers, fused)], rep=60)
            row = {
                "tokens": t,
                "variant": name,
                "us": us,
                "per_layer_us": us / LAYERS,
                "fraction_of_copy_bw": chain_bytes / (us * 1e-6) / bw,
                "rel_err_vs_cublas": err,
            }
            report["chains"].append(row)
            print(
                f"T={t} {name:32s} {us:8.1f} us  {us / LAYERS:6.2f} us/layer  "
                f"{row['fraction_of_copy_bw'] * 100:5.1f}% copy bw  (vs cuBLAS {err:.1e})",
                flush=True,
            )
            if not err < 1e-2:
                failures.append(f"chain T={t} {name}: {err:.2e} from cuBLAS")
    for f in failures:
        print(f"FAILED {f}")
    report["failures"] = failures
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
