"""The executor contract: what every executor offers the engine, the draft proposer, the
benchmarks and `trtc tune`, and the KV-pool sizing they share.

An executor runs one step of the contract (`trtc.contract.StepInputs`) on a device and returns
its logits. The engine never knows which one it has: the torch executor (the compiled graph
with the plugin references, CPU), the CUDA executor (the same graph on a GPU with the Triton
kernels and CUDA graphs), the TensorRT executor (an engine of the artifact) and the
tensor-parallel one (rank 0 driving the others). Every member a caller may use is declared
here, with the default an executor that has nothing to say keeps; callers never probe for one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from trtc.artifact import Manifest
from trtc.errors import ArtifactError

if TYPE_CHECKING:
    import torch

    from trtc.contract import StepInputs
    from trtc.runtime.engine.startup import StartupPhases

EXECUTORS = ("auto", "torch", "cuda", "tensorrt")


class Executor(ABC):
    #: "torch", "cuda" or "tensorrt" (what `EngineStats.executor` and the logs say).
    name: ClassVar[str]
    #: Whether `execute` takes ``input_ids`` already on the device: async scheduling feeds a
    #: step the ids the step before it sampled there, without reading them back.
    takes_device_input_ids: ClassVar[bool] = False

    # Set by every executor's constructor.
    manifest: Manifest
    block_size: int  # tokens a KV block holds
    num_blocks: int  # blocks of the KV pool this executor allocated
    device: torch.device  # where the logits it returns live (and the sampler draws)
    startup: StartupPhases  # what its start took, phase by phase (the engine's log, /metrics)

    @abstractmethod
    def execute(self, step: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``step`` and return its logits ``[len(step.logits_indices), vocab]`` fp32 on
        `device`, valid until the next call; the KV pool is updated in place. ``input_ids``
        (only where `takes_device_input_ids`): a tensor on the device that replaces the first
        ``len(input_ids)`` of the step's ids (the previous step's sampled tokens, one per row
        it decodes; rows admitted after them bring their own)."""

    @property
    def step_token_buckets(self) -> list[int]:
        """The token counts this executor pads multi-token steps up to (the scheduler fits
        steps to them); empty: each step runs at its own size."""
        return []

    def capture_deferred(self) -> bool:
        """Do one piece of the start-up work left for after the engine is ready (a CUDA
        graph's warm-up or capture); True while some remains. Called between steps."""
        return False

    def close(self) -> None:
        """Release what the executor holds outside this process (worker processes); it runs
        no step afterwards. (Nothing, for an executor that holds nothing there.)"""
        return None


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
