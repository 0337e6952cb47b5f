"""Executors behind one interface (`base.Executor`), and the choice among them."""

from __future__ import annotations

import logging

from trtc.artifact import Artifact
from trtc.errors import ArtifactError
from trtc.runtime.executors.base import EXECUTORS, Executor, default_num_blocks

__all__ = ["EXECUTORS", "Executor", "create_executor", "default_num_blocks"]

log = logging.getLogger("trtc.executor")


def create_executor(
    name: str,
    artifact: Artifact,
    num_blocks: int | None,
    device: str = "cpu",
    defer_graphs: bool = False,
    use_tuning: bool = True,
) -> Executor:
    """``auto`` picks the TensorRT executor when the artifact has an engine this host can run,
    else CUDA where a GPU is present, else the torch executor on the CPU; it says why it passed
    over the engines. A forced ``tensorrt`` that cannot run is an error with the reason.
    ``defer_graphs``, ``use_tuning``: see `EngineConfig` (the CUDA executor's)."""
    import torch

    from trtc.engines import choose_engine

    if name not in EXECUTORS:
        raise ArtifactError(f"unknown executor {name!r} (choose from {', '.join(EXECUTORS)})")
    if artifact.manifest.parallel.tensor > 1:
        return _tensor_parallel(name, artifact, num_blocks)
    if name in ("auto", "tensorrt"):
        engine, reasons = choose_engine(artifact.manifest)
        if engine is not None:
            from trtc.runtime.executors.tensorrt_executor import TensorRTExecutor

            return TensorRTExecutor(artifact, num_blocks, engine)
        if name == "tensorrt":
            raise ArtifactError(
                f"executor 'tensorrt': no engine of {artifact.path} can run on this host: "
                + "; ".join(reasons)
            )
        fallback = "cuda" if torch.cuda.is_available() else "torch"
        (log.warning if artifact.manifest.engines else log.info)(
            "executor auto: not using a TensorRT engine (%s); using the %s executor",
            "; ".join(reasons),
            fallback,
        )
        name = fallback
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ArtifactError(
                "executor 'cuda' needs a CUDA GPU and a CUDA build of torch; none is present"
            )
        from trtc.runtime.executors.cuda_executor import CudaExecutor

        return CudaExecutor(artifact, num_blocks, use_tuning=use_tuning, defer_graphs=defer_graphs)
    from trtc.runtime.executors.torch_executor import TorchExecutor

    return TorchExecutor(artifact, num_blocks or 1024, device)


def _tensor_parallel(name: str, artifact: Artifact, num_blocks: int | None) -> Executor:
    """A tensor-parallel artifact: its ranks on the CUDA executor (a GPU each) or the torch
    executor (CPU, gloo)."""
    import torch

    from trtc.runtime.distributed.executor import TensorParallelExecutor

    if name == "tensorrt":
        raise ArtifactError(
            f"executor 'tensorrt': {artifact.path} is split over "
            f"{artifact.manifest.parallel.tensor} tensor-parallel ranks and has no engines; "
            "use the cuda or torch executor"
        )
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "torch"
    if name == "cuda" and not torch.cuda.is_available():
        raise ArtifactError(
            "executor 'cuda' needs a CUDA GPU and a CUDA build of torch; none is present"
        )
    return TensorParallelExecutor(artifact, name, num_blocks)
