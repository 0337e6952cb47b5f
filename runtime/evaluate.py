"""`trtc eval`: perplexity of an artifact on a text, computed by the runtime's executor on the
compiled graph, so any artifact (quantized or not) can be compared with its source."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from trtc.compiler.artifact import read_manifest
from trtc.runtime.executor import create_executor
from trtc.runtime.step import SequenceWork, make_step


def perplexity(artifact: str | Path, text: str, window: int = 512, max_windows: int | None = None,
               executor: str = "auto") -> dict:
    """Non-overlapping windows of ``window`` tokens, each a fresh sequence run as one prefill
    whose every position returns logits (the contract's ``logits_indices`` may name any rows)."""
    from transformers import AutoTokenizer
    manifest = read_manifest(artifact)
    tokenizer = AutoTokenizer.from_pretrained(str(Path(artifact) / "tokenizer"))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    window = min(window, manifest["limits"]["max_num_tokens"], manifest["limits"]["max_seq_len"])
    block_size = manifest["kv_cache"]["block_size"]
    blocks = -(-window // block_size)
    run = create_executor(executor, artifact, blocks + 1)
    starts = list(range(0, len(ids) - 1, window))[:max_windows]
    if not starts or len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} tokens; perplexity needs at least 2")
    nll, count = 0.0, 0
    for start in starts:
        chunk = ids[start:start + window + 1]
        inputs, targets = chunk[:-1], torch.tensor(chunk[1:])
        step = make_step([SequenceWork(inputs, 0, list(range(blocks)))], block_size)
        step["logits_indices"] = torch.arange(len(inputs), dtype=torch.int64)
        logits = run.execute(step).float().cpu()
        nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(targets)
    return {"perplexity": math.exp(nll / count), "tokens": count, "windows": len(starts), "window": window}
