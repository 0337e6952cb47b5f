"""A tensor-parallel rank: its executor, and the loop a worker runs.

Every rank, the driver's included, makes its executor the same way (`rank_executor`): its
graph of the artifact, its KV pool of the agreed size, the AllReduce nodes bound to the
device group. A worker (`run_worker`) then runs whatever step the driver broadcasts until the
driver says stop; it owns no scheduler and returns nothing (rank 0's logits are the ones the
driver samples from, and every rank computes the same).

A spawned worker (`spawned_worker`) ignores Ctrl-C and SIGTERM (a terminal or a service
manager sends them to the whole process group; the driver stops its workers itself, after
its graceful shutdown) and exits when the driver's process is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch

from trtc.artifact import Artifact
from trtc.runtime.distributed.broadcast import receive_step
from trtc.runtime.distributed.group import Groups, destroy_groups, device_for, init_groups
from trtc.runtime.distributed.rank_env import RankEnv

log = logging.getLogger("trtc.distributed")

# A rank that does not know the pool size proposes this; the agreed size is the minimum.
_ANY = 2**62


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to become its rank (picklable: it crosses ``spawn``)."""

    artifact: str
    kind: str  # the executor: torch | cuda
    num_blocks: int | None  # None: every rank proposes what its device holds
    env: RankEnv


def rank_executor(
    kind: str, artifact: Artifact, num_blocks: int | None, env: RankEnv, groups: Groups
):
    """Rank ``env.rank``'s executor. The ranks agree on the pool size first (the smallest any
    of them proposes): one block table indexes every rank's pool."""
    import torch.distributed as dist

    from trtc.plugins.all_reduce import use_group

    use_group(groups.device)
    device = device_for(env, kind == "cuda")
    proposed = num_blocks
    if proposed is None:
        if kind == "cuda":
            from trtc import envs
            from trtc.runtime.executors.kv_pool_sizing import pool_blocks

            proposed = pool_blocks(
                artifact.manifest,
                device,
                int4_fragments=envs.TRTC_INT4_FRAGMENTS,
                mixed_graphs=envs.TRTC_MIXED_GRAPHS,
            )
        else:
            proposed = _ANY
    agreed = torch.tensor([proposed], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=groups.control)
    blocks = int(agreed.item())
    if blocks == _ANY:
        raise RuntimeError(
            "no rank of the tensor-parallel group was given a KV pool size for the torch "
            "executor: pass num_blocks (trtc serve --num-blocks, or EngineConfig.num_blocks)"
        )
    if kind == "cuda":
        from trtc.runtime.executors.cuda_executor import CudaExecutor

        return CudaExecutor(artifact, blocks, str(device), rank=env.rank)
    from trtc.runtime.executors.torch_executor import TorchExecutor

    return TorchExecutor(artifact, blocks, str(device), rank=env.rank)


def run_worker(spec: WorkerSpec) -> None:
    """Be rank ``spec.env.rank``: join the group, load the rank's graph, run the driver's
    steps until it says stop."""
    groups = init_groups(spec.env, spec.kind == "cuda")
    try:
        executor = rank_executor(
            spec.kind, Artifact.open(spec.artifact), spec.num_blocks, spec.env, groups
        )
        log.info("rank %d ready (%s executor)", spec.env.rank, executor.name)
        while (
            received := receive_step(groups.control, groups.device, executor.device)
        ) is not None:
            step, input_ids = received
            if input_ids is None:
                executor.execute(step)
            else:
                executor.execute(step, input_ids=input_ids)
    finally:
        destroy_groups()


def _exit_with_parent(parent: int) -> None:
    """Exit when the driver's process is gone (its group connections may outlive it)."""

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="trtc-parent-watch").start()


def spawned_worker(spec: WorkerSpec, parent: int, log_level: int) -> None:
    """The entry point of a worker the driver spawned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent(parent)
    logging.basicConfig(
        level=log_level,
        format=f"[trtc rank {spec.env.rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        run_worker(spec)
    except BaseException:
        log.exception("tensor-parallel rank %d failed", spec.env.rank)
        sys.stderr.flush()
        os._exit(1)
