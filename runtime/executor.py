"""Executors run one step of the contract on a device. All implement
``execute(step) -> logits`` with ``block_size`` and ``num_blocks`` attributes; the engine never
knows which one it has: the torch executor (the compiled graph with the plugin references, CPU),
the CUDA executor (the same graph on a GPU with the Triton kernels and CUDA graphs) and the
TensorRT executor (an engine of the artifact, `tensorrt_executor.py`)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from trtc.compiler.errors import ArtifactError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("trtc.executor")

EXECUTORS = ("auto", "torch", "cuda", "tensorrt")


class Executor(Protocol):
    name: str
    block_size: int
    num_blocks: int

    def execute(self, step: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` fp32, on the executor's device, valid until the next call.
        An executor with ``takes_device_input_ids = True`` also takes ``input_ids=`` a tensor on
        its device that replaces the step's (async scheduling: the previous step's sampled ids)."""


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


def create_executor(name: str, artifact_dir: str | Path, num_blocks: int | None, device: str = "cpu") -> Executor:
    """``auto`` picks the TensorRT executor when the artifact has an engine this host can run,
    else CUDA where a GPU is present, else the torch executor on the CPU; it says why it passed
    over the engines. A forced ``tensorrt`` that cannot run is an error with the reason."""
    import torch
    if name not in EXECUTORS:
        raise ArtifactError(f"unknown executor {name!r} (choose from {', '.join(EXECUTORS)})")
    if name in ("auto", "tensorrt"):
        from trtc.compiler.artifact import read_manifest
        from trtc.runtime.tensorrt_executor import TensorRTExecutor, choose_engine
        manifest = read_manifest(artifact_dir)
        engine, reasons = choose_engine(manifest)
        if engine is not None:
            return TensorRTExecutor(artifact_dir, num_blocks, engine)
        if name == "tensorrt":
            raise ArtifactError(f"executor 'tensorrt': no engine of {artifact_dir} can run on this host: "
                                + "; ".join(reasons))
        fallback = "cuda" if torch.cuda.is_available() else "torch"
        (log.warning if manifest.get("engines") else log.info)(
            "executor auto: not using a TensorRT engine (%s); using the %s executor", "; ".join(reasons), fallback)
        name = fallback
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ArtifactError("executor 'cuda' needs a CUDA GPU and a CUDA build of torch; none is present")
        from trtc.runtime.cuda_executor import CudaExecutor
        return CudaExecutor(artifact_dir, num_blocks)
    from trtc.runtime.torch_executor import TorchExecutor
    return TorchExecutor(artifact_dir, num_blocks or 1024, device)
