"""`trtc eval`: perplexity of an artifact on a text, computed by the runtime's executor on the
compiled graph, so any artifact (quantized or not) can be compared with its source."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from trtc.artifact import Artifact
from trtc.contract import SequenceWork, make_step
from trtc.runtime.executors import create_executor


def perplexity(
    artifact: str | Path | Artifact,
    text: str,
    window: int = 512,
    max_windows: int | None = None,
    executor: str = "auto",
    bos: bool = True,
) -> dict:
    """Non-overlapping windows of ``window`` tokens, each a fresh sequence run as one prefill
    whose every position returns logits (the contract's ``logits_indices`` may name any rows).

    ``bos``: each window is preceded by the tokenizer's BOS token as context that is not scored
    (the lm-evaluation-harness convention), so every window opens the way a served prompt does.
    Without it a window's first text token is also the model's attention sink, and a text that
    opens with an unusual token can wreck a whole window (docs/quantization.md shows one).
    A tokenizer without a BOS token gets no prefix."""
    from trtc.runtime.engine.tokenizer import load_tokenizer

    if not isinstance(artifact, Artifact):
        artifact = Artifact.open(artifact)
    manifest = artifact.manifest
    tokenizer = load_tokenizer(artifact.tokenizer_dir)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prefix = [tokenizer.bos_token_id] if bos and tokenizer.bos_token_id is not None else []
    limit = min(manifest.limits.max_num_tokens, manifest.limits.max_seq_len)
    window = min(window, limit - len(prefix))
    block_size = manifest.kv_cache.block_size
    blocks = -(-(window + len(prefix)) // block_size)
    starts = list(range(0, len(ids) - 1, window))[:max_windows]
    if not starts or len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} tokens; perplexity needs at least 2")
    run = create_executor(executor, artifact, blocks + 1)
    try:
        nll, count = _score(run, ids, starts, window, prefix, blocks, block_size)
    finally:
        run.close()  # a tensor-parallel executor's workers
    return {
        "perplexity": math.exp(nll / count),
        "tokens": count,
        "windows": len(starts),
        "window": window,
        "bos": bool(prefix),
    }


def _score(run, ids, starts, window, prefix, blocks, block_size) -> tuple[float, int]:
    """Summed negative log-likelihood and the number of tokens scored."""
    nll, count = 0.0, 0
    for start in starts:
        chunk = ids[start : start + window + 1]
        inputs, targets = prefix + chunk[:-1], torch.tensor(chunk[1:])
        step = make_step([SequenceWork(inputs, 0, list(range(blocks)))], block_size)
        # Rows of the text's positions only: the prefix predicts the text's first token, which
        # no window without a prefix scores either.
        step.logits_indices = torch.arange(len(prefix), len(inputs), dtype=torch.int64)
        logits = run.execute(step).float().cpu()
        nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(targets)
    return nll, count
