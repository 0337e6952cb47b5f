"""Executors run one step of the contract on a device. All implement
``execute(step) -> logits`` with ``block_size`` and ``num_blocks`` attributes; the engine never
knows which one it has. Today: the torch executor (CPU; the compiled graph with plugin references)."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from trtc.compiler.errors import ArtifactError

EXECUTORS = ("auto", "torch")


class Executor(Protocol):
    name: str
    block_size: int
    num_blocks: int

    def execute(self, step: dict[str, torch.Tensor]) -> torch.Tensor: ...


def default_num_blocks(manifest: dict, kv_cache_memory: int, max_num_seqs: int) -> int:
    """As many blocks as ``kv_cache_memory`` bytes hold, but no more than every sequence at full
    context needs (a bigger pool would only waste memory)."""
    kv = manifest["kv_cache"]
    by_memory = kv_cache_memory // kv["bytes_per_block"]
    per_seq = -(-manifest["limits"]["max_seq_len"] // kv["block_size"])
    blocks = min(by_memory, per_seq * max_num_seqs)
    if blocks < per_seq:
        raise ArtifactError(f"a KV pool of {kv_cache_memory / 2**20:.0f} MiB holds {by_memory} blocks, "
                            f"fewer than one full-length sequence needs ({per_seq}); raise the KV-cache memory")
    return int(blocks)


def create_executor(name: str, artifact_dir: str | Path, num_blocks: int, device: str = "cpu") -> Executor:
    if name not in EXECUTORS:
        raise ArtifactError(f"unknown executor {name!r} (choose from {', '.join(EXECUTORS)})")
    from trtc.runtime.torch_executor import TorchExecutor
    return TorchExecutor(artifact_dir, num_blocks, device)
