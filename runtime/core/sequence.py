"""A request as the engine sees it: its tokens, how far its KV cache has got, and how to sample
it."""

from __future__ import annotations

import time
from enum import Enum, auto
from typing import TYPE_CHECKING

from trtc.contract import SequenceWork
from trtc.runtime.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from trtc.runtime.core.proposal import Proposal

__all__ = ["SamplingParams", "Sequence", "SequenceStatus"]


class SequenceStatus(Enum):
    WAITING = auto()  # queued, holds no KV blocks (new, or preempted)
    RUNNING = auto()  # admitted: holds blocks, gets tokens scheduled each step
    FINISHED = auto()  # done; its blocks are back in the pool


class Sequence:
    """One request. ``token_ids`` is prompt + generated; the first ``num_computed_tokens`` of them
    have their K/V in the blocks of ``block_table``."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError(
                f"request {request_id!r}: the prompt is empty (it needs at least one token)"
            )
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_prefix_tokens = 0  # computed tokens found in the prefix cache at admission
        self.block_table: list[int] = []
        # Chain hashes of its full blocks, and how many of its blocks the prefix cache has
        # looked at since it got them (both kept by the block manager).
        self.block_hashes: list[bytes] = []
        self.num_checked_blocks = 0
        self.params = params if params is not None else SamplingParams()
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop", "length" or "abort"
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Draft tokens to verify in the next step (set by the engine's proposer, taken by the
        # scheduler when it schedules the sequence).
        self.proposal: Proposal | None = None
        # Speculation backs off from a sequence whose drafts keep failing (none proposed, or
        # none accepted): it gets none until the engine's step count reaches
        # ``spec_paused_until``, a pause that doubles with each failure in a row.
        self.spec_failures = 0
        self.spec_paused_until = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model: the rest of the prompt (and of any generated text
        being recomputed after preemption), or just the last sampled token while decoding."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def to_work(self, num_new_tokens: int, skip: int = 0) -> SequenceWork:
        """This sequence's share of the next step: its next ``num_new_tokens`` uncomputed tokens
        after the first ``skip`` (computed by a step still running)."""
        start = self.num_computed_tokens + skip
        if not 1 <= num_new_tokens <= len(self.token_ids) - start:
            raise ValueError(
                f"{self.request_id!r}: cannot schedule {num_new_tokens} tokens, "
                f"{len(self.token_ids) - start} are uncomputed"
            )
        return SequenceWork(
            new_tokens=self.token_ids[start : start + num_new_tokens],
            num_cached=start,
            block_table=list(self.block_table),
        )
