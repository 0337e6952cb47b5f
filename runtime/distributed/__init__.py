"""Tensor parallelism at run time: one process per rank, the scheduler once (in the driver,
rank 0), each step broadcast to the workers, the graphs' all-reduces over torch.distributed
(NCCL on GPUs, gloo on CPU). `executor.TensorParallelExecutor` is what the engine holds;
`worker.run_worker` is what the other ranks run (spawned by the driver, or started by
torchrun: `torchrun_worker`)."""

from __future__ import annotations

from trtc.runtime.distributed.rank_env import RankEnv

__all__ = ["RankEnv", "torchrun_worker"]


def torchrun_worker(artifact: str, executor: str) -> bool:
    """Under torchrun (``RANK``/``WORLD_SIZE`` set), a process of rank > 0 is a worker: it runs
    the driver's steps until the driver stops, then returns True. Rank 0 and processes not
    started by a launcher return False at once (they go on to drive)."""
    env = RankEnv.from_environ()
    if env is None or env.world_size == 1 or env.rank == 0:
        return False
    import torch

    from trtc.artifact import read_manifest
    from trtc.errors import ArtifactError
    from trtc.runtime.distributed.worker import WorkerSpec, run_worker

    ranks = read_manifest(artifact).parallel.tensor
    if ranks != env.world_size:
        raise ArtifactError(
            f"{artifact} is split over {ranks} tensor-parallel rank(s), and the launcher "
            f"started {env.world_size} (WORLD_SIZE); launch {ranks}"
        )

    kind = (
        executor
        if executor in ("torch", "cuda")
        else ("cuda" if torch.cuda.is_available() else "torch")
    )
    run_worker(WorkerSpec(artifact, kind, None, env))
    return True
