"""What every executor offers the engine, and the KV-pool sizing they share.

An executor runs one step of the contract on a device: ``execute(step) -> logits`` with
``block_size`` and ``num_blocks`` attributes. The engine never knows which one it has: the torch
executor (the compiled graph with the plugin references, CPU), the CUDA executor (the same graph
on a GPU with the Triton kernels and CUDA graphs) and the TensorRT executor (an engine of the
artifact).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from trtc.artifact import Manifest
from trtc.errors import ArtifactError

if TYPE_CHECKING:
    import torch

    from trtc.contract import StepInputs

EXECUTORS = ("auto", "torch", "cuda", "tensorrt")


class Executor(Protocol):
    name: str
    block_size: int
    num_blocks: int

    def execute(self, step: StepInputs) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` fp32, on the executor's device, valid until the next call.
        An executor with ``takes_device_input_ids = True`` also takes ``input_ids=`` a tensor on
        its device that replaces the first ``len(input_ids)`` of the step's (async scheduling:
        the previous step's sampled ids, one per row it decodes; rows admitted after them bring
        their own). An executor that pads multi-token steps up to token buckets names them in
        ``step_token_buckets`` (the scheduler fits steps to them); one without runs each step
        at its own size."""


def default_num_blocks(manifest: Manifest, kv_cache_memory: int, max_num_seqs: int) -> int:
    """As many blocks as ``kv_cache_memory`` bytes hold, but no more than every sequence at full
    context needs (a bigger pool would only waste memory)."""
    kv = manifest.kv_cache
    by_memory = kv_cache_memory // kv.bytes_per_block
    per_seq = -(-manifest.limits.max_seq_len // kv.block_size)
    blocks = min(by_memory, per_seq * max_num_seqs)
    if blocks < per_seq:
        raise ArtifactError(
            f"a KV pool of {kv_cache_memory / 2**20:.0f} MiB holds {by_memory} blocks, fewer than "
            f"one full-length sequence needs ({per_seq}); raise the KV-cache memory"
        )
    return int(blocks)
