"""In-flight batching with chunked prefill, as vLLM v1 does it.

Each step has a token budget. Running sequences are served first (a decode token each, or the next
chunk of a prompt still being prefilled), then waiting sequences are admitted in arrival order, a
long prompt taking as much of the budget as is left. So one step mixes prefill chunks and decode
tokens, and a short request never waits for a long one to finish.

A running sequence that carries a proposal (speculative decoding) runs its last token and the
proposal's drafts in the step, if the budget and the pool allow; otherwise the drafts are
dropped, never another sequence preempted for them. Its verified tokens are appended by
``postprocess``, which gives back the slots of rejected drafts.

An executor that runs multi-token steps padded up to token buckets (the CUDA executor's graphs)
names them, and a step that would land just above one is cut down to it: the last prefill
chunk gives up the tokens above the bucket to the next step, when they are fewer than the
padding the step would otherwise run (the deferred tokens are computed anyway; the padding is
not).

When the pool has no block left for a running sequence, the most recently admitted sequences are
preempted: their blocks are freed and they go back to the front of the queue, to be recomputed
(prompt and generated tokens alike) once there is room. No request fails for lack of cache, because
``add`` only accepts requests that fit the pool alone.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trtc.contract import SequenceWork
from trtc.runtime.core.block_manager import BlockManager
from trtc.runtime.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from trtc.runtime.core.proposal import Proposal


@dataclass(slots=True)
class ScheduledRow:
    """One sequence's share of a step: the tokens it runs (its uncomputed tokens after the
    first ``pending``, then the drafts of its proposal if it has one)."""

    seq: Sequence
    num_new_tokens: int  # uncomputed tokens run, drafts included
    proposal: Proposal | None
    # Whether the step reaches the end of the sequence's tokens, so its logits give the next
    # token (False for a prefill chunk that is not the last). Fixed at schedule time.
    samples: bool
    # Tokens of its sequence that the step before this one computes and the host has not
    # counted yet (a prompt chunk continued in a step scheduled ahead); this row's tokens
    # start after them.
    pending: int = 0

    @property
    def num_drafts(self) -> int:
        return len(self.proposal) if self.proposal else 0

    @property
    def num_logits(self) -> int:
        """Logits rows of this row: its last token's, and one per draft."""
        return 1 + self.num_drafts

    def to_work(self) -> SequenceWork:
        """This row as the step contract's input (call before ``postprocess``)."""
        if not self.proposal:
            return self.seq.to_work(self.num_new_tokens, skip=self.pending)
        work = self.seq.to_work(self.num_new_tokens - len(self.proposal))
        work.new_tokens += self.proposal.tokens
        work.num_logits = 1 + len(self.proposal)
        return work


@dataclass
class ScheduledBatch:
    """One step: a `ScheduledRow` per sequence, in step order, and the sequences the step
    preempted to make room."""

    rows: list[ScheduledRow] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Scheduled ahead (`Scheduler.schedule_ahead`): its first ``ahead`` rows each decode the
    # token the previous step samples for its row of the same index, which the host has not
    # seen yet (the executor takes those ids on the device); rows after them were admitted.
    ahead: int = 0
    # Which rows of the previous step those are, when not all of them in order (the rows of
    # sequences that ended meanwhile are left out).
    ahead_rows: list[int] | None = None

    def add(
        self,
        seq: Sequence,
        num_new_tokens: int,
        proposal: Proposal | None = None,
        pending: int = 0,
        decodes_unseen: bool = False,
    ) -> None:
        """Schedule ``num_new_tokens`` of ``seq``'s uncomputed tokens (after its first
        ``pending``) and ``proposal``'s drafts: the one way a row is made. ``decodes_unseen``:
        the row decodes the token the step before samples, not appended yet (a step scheduled
        ahead); it samples the token after it."""
        drafts = len(proposal) if proposal else 0
        reaches_end = seq.num_computed_tokens + pending + num_new_tokens == seq.num_tokens
        samples = decodes_unseen or reaches_end
        self.rows.append(ScheduledRow(seq, num_new_tokens + drafts, proposal, samples, pending))

    @property
    def seqs(self) -> list[Sequence]:
        return [row.seq for row in self.rows]

    @property
    def speculative(self) -> bool:
        return any(row.proposal for row in self.rows)

    def __iter__(self) -> Iterator[ScheduledRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(row.num_new_tokens for row in self.rows)

    def to_work(self) -> list[SequenceWork]:
        """The step contract's input (call before ``postprocess``, which advances the sequences).
        A row scheduled ahead holds a placeholder input token, at the position after its
        sequence's last known token."""
        ahead = [
            SequenceWork([0], row.seq.num_tokens, list(row.seq.block_table))
            for row in self.rows[: self.ahead]
        ]
        return ahead + [row.to_work() for row in self.rows[self.ahead :]]

    def has_running(self) -> bool:
        return any(row.seq.status is SequenceStatus.RUNNING for row in self.rows)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_id: int | Iterable[int] | None = None,
        long_prefill_threshold: int = 0,
        token_buckets: Iterable[int] = (),
    ):
        """``long_prefill_threshold`` caps one sequence's prefill chunk per step (0 = no cap), so
        that a long prompt leaves room in the budget for others to start. ``token_buckets``: the
        token counts the executor pads a multi-token step up to (none: it runs each as it is)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or long_prefill_threshold < 0:
            raise ValueError(
                f"max_num_seqs={max_num_seqs} and max_num_batched_tokens="
                f"{max_num_batched_tokens} must be >= 1, long_prefill_threshold="
                f"{long_prefill_threshold} >= 0"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_threshold = long_prefill_threshold
        self.token_buckets = sorted(set(token_buckets))
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset((eos_token_id,))
        else:
            self.eos_token_ids = frozenset(eos_token_id)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the first preempted
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a request. ValueError if its params are invalid, its id is in use, or it could
        never fit the pool, even alone."""
        seq.params.validate()
        if any(s.request_id == seq.request_id for s in (*self.waiting, *self.running)):
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        # Every token but the last sampled one is fed back, so its K/V need a slot.
        max_len = seq.num_prompt_tokens + seq.params.max_tokens - 1
        bm = self.block_manager
        if bm.blocks_for(max_len) > bm.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                f"({seq.params.max_tokens}) needs {bm.blocks_for(max_len)} KV blocks of "
                f"{bm.block_size} tokens, but the whole pool has {bm.num_blocks}"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        # 1. Running sequences, oldest first. When one cannot grow, the newest give way to it.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, seq.num_uncomputed_tokens, budget)
            proposal = self._drafts_that_fit(seq, n, budget)
            if proposal:
                batch.add(seq, n, proposal)
                budget -= n + len(proposal)
                i += 1
                continue
            while not self.block_manager.ensure_capacity(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.add(seq, n)
                budget -= n
                i += 1
                continue
            break  # seq preempted itself: it was the last running one

        # 2. Waiting sequences, in order; not in a step that had to preempt (the pool is short, and
        # the preempted sequences, first in line, would only take back the blocks just freed).
        if not batch.preempted:
            self._admit(batch, budget)
        self._fit_to_bucket(batch)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Admit waiting sequences into ``batch``, in order, while the budget, the sequence
        limit and the pool allow (a prompt may start with a chunk)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.cached_prefix_blocks(seq)
            num_cached = len(cached) * self.block_manager.block_size
            n = self._chunk(seq, seq.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(seq, num_cached + n, cached):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n

    def schedule_ahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The step after ``batch``, scheduled while ``batch`` still runs (before its sampled tokens
        are known): each of its sequences that samples decodes the token ``batch`` samples for
        it, each whose prompt ``batch`` computes a chunk of continues with the next chunk, and
        waiting sequences are admitted after them as ``schedule`` would (prompts are known).
        That is what ``schedule`` would give next whenever every running sequence is in
        ``batch`` and the pool has a slot for each; otherwise None, and the caller schedules
        normally once the tokens are in. (Admitting here matters to a server: a request that
        arrives while steps run would otherwise stop the pipeline for a step.)

        A row whose sequence stops on the token ``batch`` samples (EOS, a stop string, an abort)
        is computed for nothing and dropped by ``postprocess``; sequences that reach max_tokens
        with it are known in advance, so a step of nothing but those is not scheduled. Rows of
        ``batch`` whose sequences ended since it was scheduled are left out (``ahead_rows``
        names the rows of ``batch`` the decoding rows take their tokens from)."""
        previous = batch.rows
        rows = [i for i, row in enumerate(previous) if row.seq.status is SequenceStatus.RUNNING]
        decoding = [i for i in rows if previous[i].samples]
        chunks = [i for i in rows if not previous[i].samples]
        if (
            batch.speculative
            or not decoding
            or len(rows) != len(self.running)
            or len(decoding) > self.max_num_batched_tokens
            or (
                not chunks
                and all(
                    previous[i].seq.num_output_tokens + 1 >= previous[i].seq.params.max_tokens
                    for i in decoding
                )
            )
        ):
            return None
        ahead = ScheduledBatch(ahead=len(decoding))
        if len(decoding) < len(batch):
            ahead.ahead_rows = decoding
        for seq in (previous[i].seq for i in decoding):
            # Room for the position after the sampled token's: num_tokens + 1 once it is appended.
            if not self.block_manager.ensure_capacity(seq, seq.num_tokens + 1):
                return None  # growing the others was not wasted: the next step needs it
            ahead.add(seq, 1, decodes_unseen=True)
        budget = self.max_num_batched_tokens - len(decoding)
        for i in chunks:
            # ``batch``'s chunk: not yet counted (the step before it has been, `postprocess`)
            seq, pending = previous[i].seq, previous[i].num_new_tokens
            computed = seq.num_computed_tokens + pending
            n = self._chunk(seq, seq.num_tokens - computed, budget)
            if n < 1 or not self.block_manager.ensure_capacity(seq, computed + n):
                return None
            ahead.add(seq, n, pending=pending)
            budget -= n
        self._admit(ahead, budget)
        self._fit_to_bucket(ahead)
        return ahead

    def _fit_to_bucket(self, batch: ScheduledBatch) -> None:
        """Cut ``batch``'s last row, a prefill chunk, so that the step's tokens fill the token
        bucket below them, when that defers fewer tokens to the next step than the executor
        would pad this one with. The row keeps at least one token; the blocks allocated for
        the rest stay with its sequence, for the next step (which `schedule_ahead` can queue:
        it continues the chunk)."""
        buckets = self.token_buckets
        if not buckets:
            return
        total = batch.num_tokens
        j = bisect.bisect_left(buckets, total)  # buckets[j]: the one the step is padded to
        if total <= len(batch) or j == len(buckets) or buckets[j] == total or j == 0:
            return  # decode-only, run eagerly (no padding), exact, or nothing below
        cut = total - buckets[j - 1]
        last = batch.rows[-1]
        n = last.num_new_tokens
        # A decode row (n = 1) is never cut: n <= cut.
        if (
            batch.speculative
            or buckets[j - 1] <= len(batch)
            or cut >= buckets[j] - total
            or n <= cut
        ):
            return
        last.num_new_tokens = n - cut
        last.samples = False  # its last ``cut`` tokens are left for the next step

    def _drafts_that_fit(self, seq: Sequence, n: int, budget: int) -> Proposal | None:
        """``seq``'s proposal (taken from it), if the step can run all of its uncomputed tokens
        and its drafts and the pool has their slots without preempting anyone; else None."""
        proposal, seq.proposal = seq.proposal, None
        if not proposal or n != seq.num_uncomputed_tokens or n + len(proposal) > budget:
            return None
        need = seq.num_computed_tokens + n + len(proposal)
        return proposal if self.block_manager.ensure_capacity(seq, need) else None

    def _chunk(self, seq: Sequence, num_uncomputed: int, budget: int) -> int:
        n = min(num_uncomputed, budget)
        if self.long_prefill_threshold:
            n = min(n, self.long_prefill_threshold)
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)  # computed tokens -> 0: it will recompute them all
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled_token_ids: list[int | list[int] | None],
        stops_text: Callable[[Sequence], bool] | None = None,
    ) -> list[Sequence]:
        """Advance the sequences of a step that ran, and append the tokens sampled for each one
        whose tokens are now all computed (the entry of any other is ignored and may be None):
        one token, or, for a row that verified drafts, the accepted drafts and the target's
        token after them. Tokens are appended one at a time, each checked for a stop (EOS, stop
        token, length, and ``stops_text(seq)``: a stop string its text now completes), so a
        sequence ends where it would have without drafts. Returns the sequences that finished;
        their blocks are already back in the pool."""
        if len(sampled_token_ids) != len(batch):
            raise ValueError(
                f"{len(sampled_token_ids)} sampled tokens for a step of {len(batch)} sequences"
            )
        finished = []
        for row, sampled in zip(batch.rows, sampled_token_ids, strict=True):
            seq, n, drafts = row.seq, row.num_new_tokens, row.num_drafts
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or finished since the step was scheduled
            if not row.samples:
                seq.num_computed_tokens += n
                self.block_manager.cache_computed_blocks(seq)
                continue
            tokens = [int(t) for t in sampled] if isinstance(sampled, list) else [int(sampled)]
            # K/V of accepted drafts are valid: each was computed on the token now appended.
            seq.num_computed_tokens += n - drafts + len(tokens) - 1
            for token in tokens:
                seq.append_token(token)
                reason = self._stop_reason(seq, token)
                if stops_text is not None and stops_text(seq) and reason is None:
                    reason = "stop"
                if reason is not None:
                    self.finish(seq, reason)
                    finished.append(seq)
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.cache_computed_blocks(seq)
                if drafts:  # the slots of rejected drafts go back to the pool
                    self.block_manager.trim(seq, seq.num_tokens)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence now (the engine calls this on a stop string): free its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a waiting or running request with reason "abort"; None if there is none."""
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        return None
