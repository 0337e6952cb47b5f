"""A fake model for driving the scheduler without a graph, and the helpers that drive it.

The fake model keeps a token-valued "KV pool": each step writes every new token into its slot, and
reads a sequence's context back from the slots of its block table. Its next token is a function of
that context, so a stale block, a wrong prefix-cache hit or a lost token after preemption changes
the output, which the tests compare with a run that had room for everything.
"""

from __future__ import annotations

from trtc.contract import make_step
from trtc.runtime.core.block_manager import BlockManager
from trtc.runtime.core.scheduler import ScheduledBatch, Scheduler
from trtc.runtime.core.sequence import SamplingParams, Sequence

EOS = 2


class FakeModel:
    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.kv: list[int | None] = [None] * (bm.num_blocks * bm.block_size)

    def slot(self, block_table: list[int], pos: int) -> int:
        bs = self.bm.block_size
        return block_table[pos // bs] * bs + pos % bs

    def step(self, batch: ScheduledBatch, input_ids: list[int] | None = None) -> list[int]:
        """``input_ids``: a step scheduled ahead runs on the previous step's sampled tokens, as a
        device has them (the host has not appended them yet)."""
        work = batch.to_work()
        if input_ids is not None:
            assert batch.ahead == len(input_ids) and all(
                w.new_tokens == [0] and w.num_cached == s.num_tokens
                for s, w in zip(batch.seqs[: batch.ahead], work)
            )
            for w, tok in zip(work, input_ids):  # the first rows: the device's tokens
                w.new_tokens = [tok]
        tensors = make_step(work, self.bm.block_size)  # the step contract accepts it
        slots = tensors.slot_mapping.tolist()
        assert len(slots) == len(set(slots)), "two tokens of one step write the same KV slot"
        for s in slots:
            block_id = s // self.bm.block_size
            assert self.bm.ref_counts[block_id] == 1 and self.bm.hash_of_block[block_id] is None, (
                "a step writes into a shared block"
            )
        out = []
        for row, (seq, w) in enumerate(zip(batch.seqs, work)):
            for i, tok in enumerate(w.new_tokens):
                self.kv[self.slot(w.block_table, w.num_cached + i)] = tok
            n = w.num_cached + len(w.new_tokens)
            context = [self.kv[self.slot(w.block_table, p)] for p in range(n)]
            from_device = input_ids is not None and row < batch.ahead
            known = seq.token_ids + w.new_tokens if from_device else seq.token_ids
            assert context == known[:n], f"{seq.request_id}: the KV cache holds the wrong tokens"
            out.append(next_token(context))
        return out


def next_token(context: list[int]) -> int:
    # Deterministic in the whole context, and never EOS (tests that want EOS ask for it).
    return 10 + (sum((i + 1) * t for i, t in enumerate(context)) * 7919) % 1000


def run(sched: Scheduler, model: FakeModel, max_steps: int = 10_000) -> list[ScheduledBatch]:
    """Step until every request finished; returns the batches."""
    batches = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert len(batch) > 0, "no progress"
        assert batch.num_tokens <= sched.max_num_batched_tokens
        assert len(batch) <= sched.max_num_seqs and sched.num_running <= sched.max_num_seqs
        sched.postprocess(batch, model.step(batch))
        sched.block_manager.check_invariants()
        batches.append(batch)
        assert len(batches) < max_steps
    return batches


def make(num_blocks=64, block_size=16, max_num_seqs=8, budget=64, **kw):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, budget, eos_token_id=EOS, **kw), FakeModel(bm)


def seq(rid, n_prompt, max_tokens=4, start=100, **params):
    params = SamplingParams(max_tokens=max_tokens, **params)
    return Sequence(rid, list(range(start, start + n_prompt)), params)
