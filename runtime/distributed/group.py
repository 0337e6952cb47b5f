"""Who this process is among the tensor-parallel ranks, and the process groups they share.

Two groups, as vLLM keeps them: the *device group* (NCCL on GPUs, gloo on CPU) carries the
graphs' all-reduces and nothing else; the *control group* (always gloo, on host tensors) carries
each step's inputs from the driver (rank 0, where the scheduler runs) to the workers. The
control group waits without limit, since an idle server's workers wait there for the next
step; the device group gives up after ``TRTC_DISTRIBUTED_TIMEOUT`` seconds.

Ranks find each other through torch.distributed's TCP store at ``MASTER_ADDR:MASTER_PORT``:
the variables torchrun sets are honoured (`RankEnv.from_environ`), and a driver that spawns
its own workers picks a free port on the loopback interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

from trtc import envs
from trtc.errors import ArtifactError
from trtc.runtime.distributed.rank_env import RankEnv

# The control group's timeout: an idle server waits for requests for as long as it runs.
_WAIT_FOREVER = timedelta(days=365)


@dataclass
class Groups:
    device: object  # torch.distributed ProcessGroup: the graphs' all-reduces
    control: object  # gloo: step inputs from the driver


def device_for(env: RankEnv, on_gpu: bool) -> torch.device:
    return torch.device(f"cuda:{env.local_rank}") if on_gpu else torch.device("cpu")


def check_devices(world_size: int, on_gpu: bool) -> None:
    """Refuse, before anything is loaded, more ranks than this host has GPUs."""
    if on_gpu and torch.cuda.device_count() < world_size:
        raise ArtifactError(
            f"the artifact is split over {world_size} tensor-parallel ranks, one GPU each, "
            f"and this host has {torch.cuda.device_count()} visible GPU(s); run it on a host "
            f"with {world_size} GPUs (or CUDA_VISIBLE_DEVICES listing them), rebuild with "
            "parallel.tensor matching the GPUs, or run the ranks on the CPU (--executor torch)"
        )


def init_groups(env: RankEnv, on_gpu: bool) -> Groups:
    """Join the rendezvous as ``env.rank`` and make both groups (blocks until every rank has
    joined)."""
    import torch.distributed as dist

    if on_gpu:
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(
        backend="nccl" if on_gpu else "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=envs.TRTC_DISTRIBUTED_TIMEOUT),
        **({"device_id": torch.device(f"cuda:{env.local_rank}")} if on_gpu else {}),
    )
    control = dist.new_group(backend="gloo", timeout=_WAIT_FOREVER)
    return Groups(device=dist.group.WORLD, control=control)


def destroy_groups() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
