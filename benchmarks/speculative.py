"""Speculative decoding against a token a step, same artifact, same process.

For each concurrency in ``--concurrency``, the same greedy requests run without speculation and
with the chosen proposer; the outputs must be identical (checked), and the script prints output
tokens/s, TPOT (time per output token after the first, per request, mean) and, with
speculation, the tokens a verifying sequence gains per step (accepted drafts + 1).

Proposers: ``ngram``, ``draft:DIR``, or ``oracle`` (benchmark only: replays the target's own
greedy continuation from the run without speculation: what verification costs, with nothing
to lose to rejections). A random-weight model's logits are near-ties everywhere, and its fp16
decode steps (GEMV, decode attention) and verifying steps (GEMM, prefill attention) break them
differently, so the replay is mostly rejected there; ``--force-accept`` then accepts every
oracle draft (the verifying steps' work is the same; the output is the replay by construction).

The default prompt quotes a passage and asks for it revised: the output repeats much of its
input, where prompt lookup pays. ``--prompt-tokens`` instead uses token ids 100..100+N (for
random-weight models, whose text means nothing).

``--mixed N`` measures the off-rule instead: `trtc bench`'s mixed request set (N requests,
prompts 128-1024, outputs 32-512 unless ``--prompt-len``/``--output-len`` say, seed 0) at
``--concurrency`` in flight, on one speculating engine, every request opted out
(``speculative: false``) and then opted in, ``--repeats`` times alternately (same kernels, same
graphs, same process). Speculation only runs while at most ``--max-batch`` sequences are running.

    python3 benchmarks/speculative.py ARTIFACT --speculative ngram --concurrency 1,8 \\
        [--tokens 4] [--max-tokens 256] [--executor auto] [--json FILE]
    python3 benchmarks/speculative.py ARTIFACT --speculative ngram --mixed 256 --concurrency 64
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from trtc.runtime import bench
from trtc.runtime.core.proposal import Proposal
from trtc.runtime.engine import EngineConfig, LLMEngine, SamplingParams

PASSAGE = (
    "The lighthouse stood at the end of the rocky point, its white tower streaked with rust. "
    "Every night for forty years the keeper climbed the one hundred and twelve steps to light "
    "the lamp, and every morning he wrote the weather, the ships he had seen and the state of "
    "the sea in a leather book. When the light was automated, the keeper stayed on in the "
    "cottage below, still writing in the book each morning, though no one asked him to."
)
PROMPT = (
    "Here is a paragraph:\n\n"
    f"{PASSAGE}\n\n"
    "Rewrite the paragraph in the present tense, changing nothing else.\n\nRewritten:\n"
)


class OracleProposer:
    """Proposes the target's own greedy continuation (known from a run without speculation)."""

    name = "oracle"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations  # prompt ids -> greedy output ids

    def propose(self, seqs, max_tokens):
        out = []
        for seq, k in zip(seqs, max_tokens):
            future = self.continuations[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            done = seq.num_output_tokens
            out.append(Proposal(future[done : done + k]))
        return out

    def verified(self, seq):
        pass

    def finished(self, seq):
        pass


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
    before = engine.stats().counters
    start = time.perf_counter()
    arrival, first, finish, outputs = {}, {}, {}, {}
    for p in prompts:
        rid = engine.add_request(None, params, prompt_ids=p)
        arrival[rid] = start
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                finish[out.request_id] = now
                outputs[out.request_id] = out.token_ids
    wall = time.perf_counter() - start
    after = engine.stats().counters
    tokens = sum(len(t) for t in outputs.values())
    tpots = [(finish[r] - first[r]) / max(1, len(outputs[r]) - 1) for r in outputs]
    return {
        "outputs": [outputs[r] for r in sorted(outputs, key=lambda r: int(r.split("-")[1]))],
        "output_tokens_per_s": tokens / wall,
        "tpot_ms": 1000 * sum(tpots) / len(tpots),
        "steps": after.steps - before.steps,
        "mean_accepted_length": after.since(before).mean_accepted_length,
    }


def release(engine: LLMEngine) -> None:
    """Give an engine's GPU memory back before the next one sizes its KV pool."""
    engine.close()
    engine.executor = engine.runner = engine.speculation.proposer = None  # what holds the GPU
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def mixed(args) -> list[dict]:
    """The off-rule at high concurrency: one engine, speculation off and on per request."""
    n = int(args.concurrency)
    engine = LLMEngine(
        args.artifact,
        EngineConfig(
            executor=args.executor,
            max_num_seqs=n,
            speculative=args.speculative,
            speculative_tokens=args.tokens,
            speculative_max_batch=args.max_batch,
            enable_prefix_caching=False,  # the second pass must not reuse the first one's blocks
        ),
    )
    special = set(engine.tokenizer.all_special_ids)
    vocab = engine.manifest.model.vocab_size
    prompt_len = tuple(int(x) for x in args.prompt_len.split(":"))
    output_len = tuple(int(x) for x in args.output_len.split(":"))
    requests = bench.make_requests(args.mixed, prompt_len, output_len, vocab, 0, special)
    warmup = bench.make_requests(4, prompt_len, (2, 4), vocab, 1, special)
    bench.run_engine(engine, warmup, "inflight", n)
    rows = []
    for repeat in range(args.repeats):
        for speculative in (False, True):
            r = bench.run_engine(engine, requests, "inflight", n, speculative=speculative)
            row = {
                "repeat": repeat,
                "speculative": speculative,
                "output_tokens_per_s": r["output_tokens_per_s"],
                "duration_s": r["duration_s"],
                "tpot_ms_p50": 1000 * r["tpot_s"]["p50"],
                "ttft_ms_p50": 1000 * r["ttft_s"]["p50"],
                "spec": r.get("spec"),
            }
            rows.append(row)
            spec = r.get("spec") or {}
            print(
                f"repeat {repeat}, speculation {'on ' if speculative else 'off'}: "
                f"{row['output_tokens_per_s']:.0f} output tok/s in {row['duration_s']:.2f} s, "
                f"TPOT p50 {row['tpot_ms_p50']:.2f} ms, verifications "
                f"{spec.get('verifications', 0)}, tokens per verifying step "
                f"{spec.get('mean_accepted_length') or 0:.2f}",
                flush=True,
            )
    off = [r["output_tokens_per_s"] for r in rows if not r["speculative"]]
    on = [r["output_tokens_per_s"] for r in rows if r["speculative"]]
    print(f"on / off output tok/s (mean of {args.repeats}): {sum(on) / sum(off):.3f}")
    release(engine)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--speculative", required=True, help="ngram | draft:DIR | oracle")
    ap.add_argument("--tokens", type=int, default=4, help="drafts per step (K)")
    ap.add_argument("--concurrency", default="1", help="comma-separated request counts")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="synthetic prompt of N ids")
    ap.add_argument("--executor", default="auto")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--mixed", type=int, default=0, help="the off-rule run: N mixed requests")
    ap.add_argument("--max-batch", type=int, default=8, help="--speculative-max-batch (--mixed)")
    ap.add_argument("--repeats", type=int, default=2, help="off/on pairs (--mixed)")
    ap.add_argument("--prompt-len", default="128:1024", help="MIN:MAX prompt tokens (--mixed)")
    ap.add_argument("--output-len", default="32:512", help="MIN:MAX output tokens (--mixed)")
    ap.add_argument(
        "--force-accept", action="store_true", help="oracle only: accept every draft (see above)"
    )
    args = ap.parse_args(argv)
    if args.force_accept and args.speculative != "oracle":
        ap.error("--force-accept goes with --speculative oracle")
    if args.mixed and args.speculative == "oracle":
        ap.error("--mixed runs ngram or draft:DIR")
    return args


def force_accept() -> None:
    """Verification accepts every oracle draft (``--force-accept``, see above)."""
    import trtc.runtime.speculative.verify as verify_module

    verify_module.verify = lambda logits, proposal, params, generator=None: [
        *proposal.tokens,
        int(logits[len(proposal)].argmax()),
    ]


def make_engine(args, speculative: str | None, max_batch: int) -> LLMEngine:
    """An engine of ``max_batch`` sequences, speculating with ``speculative`` (the oracle is
    installed on it afterwards, by the caller)."""
    config = EngineConfig(
        executor=args.executor,
        max_num_seqs=max(max_batch, 1),
        speculative=None if speculative == "oracle" else speculative,
        speculative_tokens=args.tokens,
        speculative_max_batch=max_batch,
    )
    return LLMEngine(args.artifact, config)


def compare(args, n: int) -> dict:
    """``n`` identical requests without speculation, then with it, each engine warmed up by the
    same requests first; the row of the comparison, printed."""
    plain = make_engine(args, None, n)
    if args.prompt_tokens:
        prompt = list(range(100, 100 + args.prompt_tokens))
    else:
        prompt = plain.apply_chat_template([{"role": "user", "content": PROMPT}])
    prompts = [prompt] * n
    # Warm-up: the same requests once, so every kernel is compiled and every graph captured
    # (multi-token graphs are captured on first use) before the timed run.
    run(plain, prompts, args.max_tokens)
    base = run(plain, prompts, args.max_tokens)
    release(plain)
    del plain
    spec = make_engine(args, args.speculative, n)
    if args.speculative == "oracle":
        spec.speculation.proposer = OracleProposer({tuple(prompt): base["outputs"][0]})
    run(spec, prompts, args.max_tokens)
    fast = run(spec, prompts, args.max_tokens)
    identical = fast["outputs"] == base["outputs"]
    row = {
        "concurrency": n,
        "speculative": args.speculative,
        "k": args.tokens,
        "identical": identical,
        "base": {k: v for k, v in base.items() if k != "outputs"},
        "spec": {k: v for k, v in fast.items() if k != "outputs"},
        "tpot_ratio": fast["tpot_ms"] / base["tpot_ms"],
        "throughput_ratio": fast["output_tokens_per_s"] / base["output_tokens_per_s"],
    }
    print(
        f"concurrency {n}: {args.speculative} K={args.tokens}: "
        f"{fast['output_tokens_per_s']:.1f} vs {base['output_tokens_per_s']:.1f} output tok/s "
        f"({row['throughput_ratio']:.2f}x), TPOT {fast['tpot_ms']:.2f} vs "
        f"{base['tpot_ms']:.2f} ms ({row['tpot_ratio']:.2f}x), tokens per verifying step "
        f"{fast['mean_accepted_length'] or 0:.2f}, steps {fast['steps']} vs {base['steps']}, "
        f"outputs identical: {identical}",
        flush=True,
    )
    release(spec)
    del spec
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.force_accept:
        force_accept()
    if args.mixed:
        results = mixed(args)
    else:
        results = [compare(args, int(c)) for c in args.concurrency.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
