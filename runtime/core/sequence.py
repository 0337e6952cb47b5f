"""A request as the engine sees it: its tokens, how far its KV cache has got, and how to sample
it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

from trtc.contract import SequenceWork

if TYPE_CHECKING:
    from trtc.runtime.speculative.proposer import Proposal


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # the caller seeds a per-request torch.Generator from it
    stop: tuple[str, ...] = ()  # stop strings: matched by the engine, which detokenizes
    stop_token_ids: tuple[int, ...] = ()  # stop even when ignore_eos is set
    ignore_eos: bool = False
    detokenize: bool = True  # False: token ids only (benchmarks), unless stop strings need text
    speculative: bool = True  # may be verified with drafts when the engine speculates

    def __post_init__(self):
        # Lists (as JSON gives them) become tuples, so the params stay hashable and immutable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first bad field, its value and what is allowed; else
        return self."""

        def bad(field: str, allowed: str):
            raise ValueError(f"{field}={getattr(self, field)!r} is invalid: must be {allowed}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if not _is_real(self.temperature) or not (0 <= self.temperature < math.inf):
            bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0 = off)")
        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            bad("top_p", "a number in (0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "an integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a tuple of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a tuple of integers >= 0")
        return self


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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
        self.block_hashes: list[
            bytes
        ] = []  # chain hashes of its full blocks, filled by the block manager
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

    def to_work(self, num_new_tokens: int) -> SequenceWork:
        """This sequence's share of the next step: its next ``num_new_tokens`` uncomputed tokens."""
        start = self.num_computed_tokens
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
