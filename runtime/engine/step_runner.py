"""A scheduled batch through the model: the executor's forward pass, then its tokens.

`launch` flattens a `ScheduledBatch` into the step contract, queues it on the executor and
starts turning its logits into tokens: rows that verified drafts get what verification emits
(`speculative.verify`), the other rows that sample one token each, drawn by the `Sampler` from
their request's generator. With ``on_device`` (async scheduling) the tokens are drawn on the
device and read back through pinned memory (`TokenReadback`), so nothing waits for the step
until its tokens are asked for, and the step after it can be queued from the ids still on the
device (`launch_ahead`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trtc.contract import make_step
from trtc.runtime.core.sampler import Sampler, make_generator, rows_tensor
from trtc.runtime.core.sampling_params import SamplingParams
from trtc.runtime.core.scheduler import ScheduledBatch
from trtc.runtime.engine.token_readback import TokenReadback
from trtc.runtime.executors.base import Executor
from trtc.runtime.speculative.policy import SpeculationPolicy
from trtc.runtime.speculative.verify import verify

# What a row that samples nothing is drawn with, when a whole step is drawn on the device.
GREEDY = SamplingParams(temperature=0.0)

# A row's tokens: one sampled token, a verifying row's emitted tokens, or None (a prompt chunk
# that does not end its prompt).
RowTokens = int | list[int] | None


@dataclass
class LaunchedStep:
    """A step queued on the executor: its batch, its token ids on the device (None when the
    host has them already), and how to get its tokens (waits for the step)."""

    batch: ScheduledBatch
    device_tokens: torch.Tensor | None
    tokens: Callable[[], list[RowTokens]]


class StepRunner:
    def __init__(self, executor: Executor, speculation: SpeculationPolicy, max_num_seqs: int):
        self.executor = executor
        self.device = executor.device  # logits, drawn ids and seeded generators live here
        self.speculation = speculation
        self.sampler = Sampler()
        self.readback = TokenReadback(self.device, max_num_seqs)
        self.generators: dict[str, torch.Generator | None] = {}

    # --- requests ---------------------------------------------------------------------------
    def new_generator(self, params: SamplingParams) -> torch.Generator | None:
        """A seeded request's generator on the device (None: torch's global one)."""
        return make_generator(params, self.device)

    def add(self, request_id: str, generator: torch.Generator | None) -> None:
        self.generators[request_id] = generator

    def drop(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    # --- steps ------------------------------------------------------------------------------
    def launch(self, batch: ScheduledBatch, on_device: bool = False) -> LaunchedStep:
        """Queue ``batch`` and start sampling it; with ``on_device``, a step in which some row
        samples leaves its token ids on the device (read when asked for)."""
        return self._launch(batch, None, on_device)

    def launch_ahead(self, ahead: ScheduledBatch, previous: LaunchedStep) -> LaunchedStep:
        """Queue ``ahead`` (`Scheduler.schedule_ahead`) on the ids ``previous`` drew on the
        device: its first rows decode them, without the host seeing them first."""
        ids = previous.device_tokens
        if ahead.ahead_rows is not None:  # rows of ended sequences left out
            ids = ids.index_select(0, rows_tensor(ahead.ahead_rows, torch.int64, ids.device))
        return self._launch(ahead, ids, on_device=True)

    def _launch(
        self, batch: ScheduledBatch, input_ids: torch.Tensor | None, on_device: bool
    ) -> LaunchedStep:
        step = make_step(batch.to_work(), self.executor.block_size)
        logits = self.executor.execute(step, input_ids)
        if batch.speculative:
            tokens = self._verify(batch, logits)
            return LaunchedStep(batch, None, lambda: tokens)
        if on_device and any(row.samples for row in batch):
            ids = self._sample_on_device(batch, logits)
            return LaunchedStep(batch, ids, self.readback.start(ids))
        tokens = self._sample(batch, logits)
        return LaunchedStep(batch, None, lambda: tokens)

    def _sample_on_device(self, batch: ScheduledBatch, logits: torch.Tensor) -> torch.Tensor:
        """Every row's id on the device, nothing waiting for the step. A prompt chunk that
        does not end its prompt takes the argmax, ignored (its request's generator untouched);
        the next step takes the ids of the rows that sample."""
        params = [row.seq.params if row.samples else GREEDY for row in batch]
        generators = [self.generators[row.seq.request_id] if row.samples else None for row in batch]
        return self.sampler.sample_on_device(logits, params, generators)

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[RowTokens]:
        """A token for each row that samples, on the host; None for the others."""
        sampling = [i for i, row in enumerate(batch.rows) if row.samples]
        tokens: list[RowTokens] = [None] * len(batch)
        if sampling:
            seqs = [batch.rows[i].seq for i in sampling]
            rows = logits if len(sampling) == len(batch) else logits[sampling]  # no gather if all
            generators = [self.generators[s.request_id] for s in seqs]
            picked = self.sampler.sample(rows, [s.params for s in seqs], generators)
            for i, t in zip(sampling, picked):
                tokens[i] = t
        return tokens

    def _verify(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[RowTokens]:
        """The tokens of a step in which some rows verified drafts: those rows get what
        verification emits, the other sampling rows one token each."""
        starts = list(itertools.accumulate((row.num_logits for row in batch), initial=0))
        tokens: list[RowTokens] = [None] * len(batch)
        plain = [i for i, row in enumerate(batch.rows) if row.samples and not row.proposal]
        if plain:
            rows = logits[torch.tensor([starts[i] for i in plain], device=logits.device)]
            seqs = [batch.rows[i].seq for i in plain]
            generators = [self.generators[s.request_id] for s in seqs]
            for i, t in zip(plain, self.sampler.sample(rows, [s.params for s in seqs], generators)):
                tokens[i] = t
        for i, row in enumerate(batch.rows):
            if row.proposal:
                seq = row.seq
                rows = logits[starts[i] : starts[i + 1]]
                emitted = verify(rows, row.proposal, seq.params, self.generators[seq.request_id])
                self.speculation.verified(seq, row.proposal, len(emitted) - 1)
                tokens[i] = emitted
        return tokens
