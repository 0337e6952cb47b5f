"""Where a process stands in a tensor-parallel launch (rank, world size, rendezvous), read from
the launcher's environment: free of torch, so that a server learns it is no rank of a launch
before it imports anything heavy."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from trtc.errors import ArtifactError


@dataclass(frozen=True)
class RankEnv:
    """One rank's place in the group and the rendezvous address."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls) -> RankEnv | None:
        """The rank torchrun (or any launcher setting its variables) gave this process, or
        None when the process was not launched that way."""
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            return None
        try:
            return cls(
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
                master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(os.environ.get("MASTER_PORT", "29500")),
            )
        except ValueError as e:
            raise ArtifactError(
                f"RANK/WORLD_SIZE/LOCAL_RANK/MASTER_PORT must be integers ({e})"
            ) from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
