"""The golden scenario shared by the tiny-model and SmolLM2 checks: drive an artifact's compiled
graph through onnxruntime step by step and compare every returned row of logits with
transformers run on the same tokens."""

from __future__ import annotations

import numpy as np
import torch

from harness.onnx_reference import OnnxReferenceRunner
from trtc.contract import SequenceWork


class Sequence:
    """A sequence's tokens and its blocks (handed out in scattered order to cross boundaries)."""

    def __init__(self, tokens: list[int], blocks: list[int]):
        self.tokens = list(tokens)
        self.blocks = blocks
        self.cached = 0

    def work(self, n_new: int | None = None) -> SequenceWork:
        new = (
            self.tokens[self.cached :]
            if n_new is None
            else self.tokens[self.cached : self.cached + n_new]
        )
        return SequenceWork(new, self.cached, self.blocks)


class GoldenRun:
    def __init__(self, artifact, hf_model, num_blocks: int = 64):
        self.runner = OnnxReferenceRunner(artifact, num_blocks)
        self.hf = hf_model
        self.max_diff = 0.0
        self.rows = 0
        self.free = list(range(num_blocks))[::-1]
        self.free = self.free[1::2] + self.free[0::2]  # non-contiguous block order

    def sequence(self, tokens: list[int], max_len: int) -> Sequence:
        n = -(-max_len // self.runner.block_size)
        return Sequence(tokens, [self.free.pop() for _ in range(n)])

    def reference(self, seq: Sequence) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([seq.tokens])).logits[0]

    def step(self, items: list[tuple[Sequence, int | None]], append_greedy: bool = True) -> None:
        """Run one step over ``(sequence, number of new tokens or None for all pending)``, check
        each sequence's logits against transformers, then append the greedy token to each
        sequence whose pending tokens were all consumed."""
        works = [seq.work(n) for seq, n in items]
        logits = self.runner.step(works)
        for (seq, _), work, row in zip(items, works, logits):
            seq.cached += len(work.new_tokens)
            ref = self.reference(seq)[seq.cached - 1].numpy()
            diff = float(np.abs(row - ref).max())
            self.max_diff = max(self.max_diff, diff)
            self.rows += 1
            assert diff < 1e-2, f"position {seq.cached - 1}: max |logit diff| {diff:.3g}"
            assert int(row.argmax()) == int(ref.argmax()), (
                f"position {seq.cached - 1}: argmax {int(row.argmax())} "
                f"vs transformers {int(ref.argmax())}"
            )
            if append_greedy and seq.cached == len(seq.tokens):
                seq.tokens.append(int(row.argmax()))


def run_scenario(
    artifact, hf_model, prompt_a: list[int], prompt_b: list[int], prompt_c: list[int]
) -> GoldenRun:
    """The issue's scenario: A as one 40-token prefill, 16 decode steps; then B prefilled in
    the same step as A's next decode; then C's prompt in two prefill chunks, the second one
    batched with decode tokens of A and B."""
    run = GoldenRun(artifact, hf_model)
    assert len(prompt_a) == 40
    a = run.sequence(prompt_a, 128)
    run.step([(a, None)])
    for _ in range(16):
        run.step([(a, None)])
    b = run.sequence(prompt_b, 128)
    run.step([(a, None), (b, None)])
    run.step([(b, None), (a, None)])
    c = run.sequence(prompt_c, 128)
    half = len(prompt_c) // 2
    run.step([(c, half)], append_greedy=False)
    run.step([(a, None), (c, None), (b, None)])
    run.step([(a, None), (b, None), (c, None)])
    return run


def greedy_continuation(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` for one prompt alone, EOS ignored: the tokens it adds.
    The mask is explicit: token 0 in a prompt is not padding."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
