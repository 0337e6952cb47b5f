"""The executor of a tensor-parallel artifact, as the engine sees it: one executor.

The driver (this process, rank 0) starts a worker process per other rank (torch
multiprocessing, ``spawn``), or, under torchrun, finds them started; every rank loads its own
graph (`worker.rank_executor`). Each ``execute`` broadcasts the step to the workers and runs
rank 0's graph; the graphs' all-reduces meet inside the step, and rank 0's logits are the
result (every rank computes the same logits: the LM head is replicated).

Failure is loud and quick: a watcher thread waits on the workers' process handles, and a
worker that exits while the executor is open ends this process with exit status 1 and the
worker's rank, pid and exit reason, within a second. Nothing can be recovered (the dead rank
held a slice of every layer and of the KV cache), and a driver blocked in a collective with a
dead peer would otherwise wait for the collective's timeout. ``close`` stops the workers
(on server shutdown, Ctrl-C, SIGTERM, or at interpreter exit).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from multiprocessing.connection import wait

import torch

from trtc.artifact import Artifact
from trtc.contract import StepInputs
from trtc.errors import ArtifactError
from trtc.runtime.distributed.broadcast import send_step, send_stop
from trtc.runtime.distributed.group import check_devices, destroy_groups, init_groups
from trtc.runtime.distributed.rank_env import RankEnv, free_port
from trtc.runtime.distributed.worker import WorkerSpec, rank_executor, spawned_worker
from trtc.runtime.engine.process_exit import exit_reason
from trtc.runtime.executors.base import Executor

log = logging.getLogger("trtc.distributed")

EXIT_WORKER_DIED = 1
_STOP_TIMEOUT = 10.0  # seconds a worker gets to leave its loop before it is killed


class TensorParallelExecutor(Executor):
    """Rank 0 of a tensor-parallel group, driving the other ranks: ``execute(step)`` runs
    the step on every rank and returns rank 0's logits."""

    takes_device_input_ids = True

    def __init__(self, artifact: Artifact, kind: str, num_blocks: int | None):
        self.world_size = artifact.manifest.parallel.tensor
        on_gpu = kind == "cuda"
        check_devices(self.world_size, on_gpu)
        self.workers = []
        self._closing = False
        self._lock = threading.Lock()  # one step at a time; close waits for the running one
        env = RankEnv.from_environ()
        if env is not None and env.world_size > 1:  # torchrun started every rank
            if env.world_size != self.world_size:
                raise ArtifactError(
                    f"{artifact.path} is split over {self.world_size} ranks, and the launcher "
                    f"started {env.world_size} (WORLD_SIZE); launch {self.world_size}"
                )
            if env.rank != 0:
                raise ArtifactError(f"rank {env.rank} is a worker; only rank 0 drives the steps")
        else:
            env = RankEnv(0, self.world_size, 0, "127.0.0.1", free_port())
            self._spawn_workers(str(artifact.path), kind, num_blocks, env)
        log.info(
            "tensor parallel: %d ranks over %s (workers: %s)",
            self.world_size,
            "NCCL" if on_gpu else "gloo",
            ", ".join(f"rank {r} pid {w.pid}" for r, w in enumerate(self.workers, 1))
            or "started by the launcher",
        )
        try:
            self.groups = init_groups(env, on_gpu)
            self.inner = rank_executor(kind, artifact, num_blocks, env, self.groups)
        except BaseException:
            self._kill_workers()
            raise
        atexit.register(self.close)
        self.startup = self.inner.startup

    # What the engine reads of an executor: rank 0's.
    name = property(lambda self: self.inner.name)
    manifest = property(lambda self: self.inner.manifest)
    device = property(lambda self: self.inner.device)
    block_size = property(lambda self: self.inner.block_size)
    num_blocks = property(lambda self: self.inner.num_blocks)

    def _spawn_workers(self, artifact: str, kind: str, num_blocks: int | None, env) -> None:
        context = torch.multiprocessing.get_context("spawn")
        for rank in range(1, self.world_size):
            spec = WorkerSpec(
                artifact,
                kind,
                num_blocks,
                RankEnv(rank, self.world_size, rank, env.master_addr, env.master_port),
            )
            process = context.Process(
                target=spawned_worker,
                args=(spec, os.getpid(), logging.getLogger("trtc").getEffectiveLevel()),
                name=f"trtc-rank{rank}",
                daemon=True,
            )
            process.start()
            self.workers.append(process)
        threading.Thread(target=self._watch, daemon=True, name="trtc-worker-watch").start()

    def _watch(self) -> None:
        """End this process when a worker dies while the executor is open (see the module)."""
        ready = wait([w.sentinel for w in self.workers])
        if self._closing:
            return
        dead = next(w for w in self.workers if w.sentinel in ready)
        rank = self.workers.index(dead) + 1
        dead.join(timeout=1)
        self._fail(
            f"worker rank {rank} (pid {dead.pid}) died ({exit_reason(dead.exitcode)}); the "
            "other ranks cannot go on without its slice of the model"
        )

    def _kill_workers(self) -> None:
        self._closing = True
        for w in self.workers:
            if w.is_alive():
                w.kill()
                w.join()

    @property
    def step_token_buckets(self) -> list[int]:
        """Rank 0's (every rank runs the step the same way)."""
        return self.inner.step_token_buckets

    def execute(self, step: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        with self._lock:
            if self._closing:
                raise RuntimeError("the tensor-parallel executor is closed")
            try:
                send_step(step, input_ids, self.groups.control, self.groups.device)
                return self.inner.execute(step, input_ids)
            except BaseException as e:
                # The workers ran (or wait in) this step's collectives: every later step would
                # pair its all-reduces with the wrong ones. Nothing can be resynchronised.
                self._fail(f"a step failed on rank 0 ({type(e).__name__}: {e})")
                raise

    def _fail(self, reason: str) -> None:
        message = f"trtc: tensor parallel: {reason}; stopping every rank"
        log.error(message)
        print(message, file=sys.stderr, flush=True)
        self._kill_workers()
        os._exit(EXIT_WORKER_DIED)

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent). A step still running gets
        ``_STOP_TIMEOUT`` seconds to end; after that the workers are killed."""
        if self._closing:
            return
        if not self._lock.acquire(timeout=_STOP_TIMEOUT):
            log.warning("a step is still running; killing the tensor-parallel workers")
            self._kill_workers()
            return
        try:
            self._closing = True
            try:
                send_stop(self.groups.control)
            except Exception as e:  # a worker already gone: the others are killed below
                log.warning("could not stop the tensor-parallel workers cleanly: %s", e)
            for w in self.workers:
                w.join(timeout=_STOP_TIMEOUT)
                if w.is_alive():
                    log.warning("rank worker pid %d did not stop; killing it", w.pid)
                    w.kill()
                    w.join()
            destroy_groups()
        finally:
            self._lock.release()
        from trtc.plugins.all_reduce import use_group

        use_group(None)
