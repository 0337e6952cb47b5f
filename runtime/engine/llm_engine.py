"""The engine: scheduler + block manager + executor + sampler + output processor, one `step()`
at a time (nano-vllm's LLMEngine: in-flight batching over the paged KV cache)."""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from trtc import envs
from trtc.artifact import Artifact
from trtc.contract import make_step
from trtc.runtime.core.block_manager import BlockManager
from trtc.runtime.core.sampler import Sampler, make_generator, rows_tensor
from trtc.runtime.core.scheduler import ScheduledBatch, Scheduler
from trtc.runtime.core.sequence import SamplingParams, Sequence, SequenceStatus
from trtc.runtime.engine.config import EngineConfig
from trtc.runtime.engine.output_processor import OutputProcessor
from trtc.runtime.engine.outputs import (
    EngineCounters,
    EngineStats,
    RequestError,
    RequestOutput,
    StepSummary,
)
from trtc.runtime.engine.request_limits import RequestLimits
from trtc.runtime.engine.startup import (
    StartupPhases,
    seconds_since_process_start,
    warn_if_uncompiled,
)
from trtc.runtime.engine.token_readback import LaunchedStep, TokenReadback
from trtc.runtime.engine.tokenizer import (
    chat_prompt_ids,
    load_detokenizer,
    load_tokenizer,
    prompt_ids_of,
)
from trtc.runtime.executors import create_executor, default_num_blocks

log = logging.getLogger("trtc.engine")

# The first engine of a process reports the interpreter and imports before it as a phase.
_first_engine = True

# What a row that samples nothing is drawn with, when a whole step is drawn on the device.
GREEDY = SamplingParams(temperature=0.0)

# Tokens that end a chat turn in the families trtc serves, beside the tokenizer's own EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>")


class LLMEngine:
    def __init__(self, artifact: str | Path | Artifact, config: EngineConfig | None = None):
        global _first_engine
        first, _first_engine = _first_engine, False
        started = time.perf_counter()
        self.startup = StartupPhases()
        if first and (before := seconds_since_process_start()) is not None:
            self.startup.record("interpreter and imports", before)
        before_engine = sum(self.startup.seconds.values())
        self.config = config = config or EngineConfig()
        self.artifact = artifact if isinstance(artifact, Artifact) else Artifact.open(artifact)
        self.manifest = self.artifact.manifest
        limits = self.manifest.limits
        self.model_name = self.manifest.name
        self.max_seq_len = limits.max_seq_len
        # The tokenizer loads on its own thread while the weights are read (file reads, hashing
        # and device copies release the GIL). A full one imports transformers, seconds that hold
        # the GIL much of the time: an engine given prompts as ids loads a decode-only one.
        tokenizer = ThreadPoolExecutor(1, thread_name_prefix="trtc-tokenizer")
        load = load_detokenizer if config.decode_only_tokenizer else load_tokenizer
        pending_tokenizer = tokenizer.submit(load, self.artifact.tokenizer_dir)
        tokenizer.shutdown(wait=False)
        with self.startup.phase("interpreter and imports"):
            from trtc.runtime.executors import torch_executor  # noqa: F401  (onnx, torch ops)
        if first:  # (what a process imports is its own: said once)
            warn_if_uncompiled(("torch", "onnx"))
        if config.speculative is not None:  # a draft model checks it has the same tokenizer
            self.tokenizer = pending_tokenizer.result()
        on_gpu = config.executor == "cuda" or (
            config.executor == "auto" and torch.cuda.is_available()
        )
        num_blocks = config.num_blocks
        if num_blocks is None and not on_gpu:  # the CUDA executor sizes its pool from GPU memory
            num_blocks = default_num_blocks(
                self.manifest, config.kv_cache_memory, config.max_num_seqs or limits.max_num_seqs
            )
        # A draft model's executor first: on a GPU the target's pool takes what it leaves.
        self.proposer = self._make_proposer(config)
        self.executor = create_executor(
            config.executor,
            self.artifact,
            num_blocks,
            config.device,
            defer_graphs=config.defer_graphs,
            use_tuning=config.use_tuning,
        )
        self.startup.update(self.executor.startup)
        with self.startup.phase("tokenizer", "what loading it beside the weights left to wait"):
            self.tokenizer = pending_tokenizer.result()
        if self.proposer is not None and self.executor.name == "tensorrt":
            raise ValueError(
                "speculative decoding needs the logits of several tokens a sequence, which the "
                "TensorRT engines (one token's a slot) do not give; use the cuda or torch executor"
            )
        self.block_manager = BlockManager(
            self.executor.num_blocks, self.executor.block_size, config.enable_prefix_caching
        )
        self.limits = RequestLimits(
            self.manifest.model.vocab_size,
            self.max_seq_len,
            self.block_manager.num_blocks,
            self.block_manager.block_size,
        )
        eos = {self.manifest.tokenizer.eos_token_id, *self._generation_eos()} - {None}
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs or limits.max_num_seqs,
            config.max_num_batched_tokens or limits.max_num_tokens,
            eos_token_id=eos,
            long_prefill_threshold=config.long_prefill_threshold,
            token_buckets=self.executor.step_token_buckets if envs.TRTC_FIT_TOKEN_BUCKETS else (),
        )
        self.sampler = Sampler()
        self.async_scheduling = self._async_scheduling(config.async_scheduling)
        # Where logits, sampled ids and the seeded requests' generators live.
        self.device = self.executor.device
        self.readback = TokenReadback(self.device, self.scheduler.max_num_seqs)
        self._ahead: LaunchedStep | None = None  # queued ahead, its tokens not read yet
        self.generators: dict[str, torch.Generator | None] = {}
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.counters = EngineCounters()
        self.last_step: StepSummary | None = None
        # What no phase above accounts for: the artifact, pool sizing, scheduler, sampler.
        timed = sum(self.startup.seconds.values()) - before_engine
        self.startup.record("engine", time.perf_counter() - started - timed)
        log.info("engine ready: %s", self.startup.summary())

    def _async_scheduling(self, wanted: bool | None) -> bool:
        able = self.executor.takes_device_input_ids
        if wanted is None:
            return able and self.executor.name == "cuda" and envs.TRTC_ASYNC_SCHEDULING
        if wanted and not able:
            raise ValueError(
                f"async scheduling needs an executor that takes input ids on its device; "
                f"the {self.executor.name} executor does not (use the cuda or torch executor)"
            )
        return wanted

    def _make_proposer(self, config: EngineConfig):
        if config.speculative is None:
            return None
        from trtc.runtime.speculative import make_proposer

        if config.speculative_tokens < 1:
            raise ValueError(f"speculative_tokens={config.speculative_tokens}: must be >= 1")
        on_cpu = config.executor == "auto" and not torch.cuda.is_available()
        return make_proposer(
            config.speculative,
            tokenizer=self.tokenizer,
            vocab_size=self.manifest.model.vocab_size,
            executor="torch" if on_cpu else config.executor,
            max_seqs=max(1, config.speculative_max_batch),
            kv_cache_memory=config.kv_cache_memory,
        )

    def _generation_eos(self) -> set[int]:
        ids = set()
        for token in END_OF_TURN_TOKENS:
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid >= 0:
                ids.add(tid)
        return ids

    # --- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return prompt_ids_of(self.tokenizer, prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.limits.check(prompt_ids, params)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_ids: list[int] | None = None,
    ) -> str:
        params = params or SamplingParams()
        prompt_ids = prompt_ids if prompt_ids is not None else self.tokenize(prompt)
        self.check_request(prompt_ids, params)
        request_id = request_id or self.new_request_id()
        seq = Sequence(request_id, prompt_ids, params)
        generator = make_generator(params, self.device)  # before the scheduler holds it
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            raise RequestError(str(e)) from None
        self.generators[request_id] = generator
        self.output_processor.add(request_id)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def finish_start_up(self) -> bool:
        """Do one piece of the start-up work left for after ready (``defer_graphs``: a CUDA
        graph captured); True while some remains. Call it between steps, never during one."""
        return self.executor.capture_deferred()

    def unfinished_request_ids(self) -> list[str]:
        return [seq.request_id for seq in (*self.scheduler.waiting, *self.scheduler.running)]

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and return its outputs.

        With async scheduling, the step after this one is queued on the device before this
        one's tokens are read (`Scheduler.schedule_ahead`; its input tokens go from this step's
        argmax to its inputs on the device), so the host's scheduling, input preparation and
        output handling overlap the GPU instead of leaving it idle between steps (tokens are
        drawn on the device, seeded requests from their own generator there). A step goes
        ahead when every running sequence is in this one and some row samples: a sampling
        row decodes its token, a prompt chunk continues with the next (rows of sequences that
        ended meanwhile are left out); waiting requests are admitted into it. A step that
        preempts, or that finishes every row by length, waits."""
        launched, self._ahead = self._ahead, None
        if launched is not None and not launched.batch.has_running():
            launched = None  # every row finished or was aborted since it was queued
        if launched is None:
            self._propose()
            batch = self.scheduler.schedule()
            if not len(batch):
                return []
            launched = self._launch(batch)
        # While speculation is on, the next step waits for this one's tokens to propose drafts.
        if launched.device_tokens is not None and not self._speculation_on():
            ahead = self.scheduler.schedule_ahead(launched.batch)
            if ahead is not None:
                ids = launched.device_tokens
                if ahead.ahead_rows is not None:  # rows of ended sequences left out
                    rows = rows_tensor(ahead.ahead_rows, torch.int64, ids.device)
                    ids = ids.index_select(0, rows)
                self._ahead = self._launch(ahead, input_ids=ids)
        return self._complete(launched.batch, launched.tokens())

    def _speculation_on(self) -> bool:
        """Whether the running sequences get drafts: a proposer, at most
        ``speculative_max_batch`` of them running, one that may speculate now. While it is
        off, the next step is queued before this one's tokens are read (async scheduling)."""
        running = self.scheduler.running
        return (
            self.proposer is not None
            and 0 < len(running) <= self.config.speculative_max_batch
            and any(self._may_speculate(s) for s in running)
        )

    def _may_speculate(self, seq: Sequence) -> bool:
        return seq.params.speculative and seq.spec_paused_until <= self.counters.steps

    # A sequence whose drafts failed n times in a row waits 2**n steps (at most this many)
    # before it is proposed for again: drafts that keep failing cost a verifying step each and
    # keep the next step from being queued ahead.
    MAX_SPECULATION_PAUSE = 64

    def _speculation_failed(self, seq: Sequence) -> None:
        seq.spec_failures += 1
        pause = min(2**seq.spec_failures, self.MAX_SPECULATION_PAUSE)
        seq.spec_paused_until = self.counters.steps + pause

    def _propose(self) -> None:
        """Give running decoders drafts to verify in the next step (`Sequence.proposal`)."""
        if not self._speculation_on():
            return
        decoding = [
            s
            for s in self.scheduler.running
            if self._may_speculate(s) and s.num_uncomputed_tokens == 1 and s.num_output_tokens
        ]
        if not decoding:
            return
        k = self.config.speculative_tokens
        # Drafts and the token after them must fit max_tokens and the context.
        limits = [
            max(
                0,
                min(
                    k, s.params.max_tokens - s.num_output_tokens - 1, self.max_seq_len - len(s) - 1
                ),
            )
            for s in decoding
        ]
        for seq, proposal, limit in zip(decoding, self.proposer.propose(decoding, limits), limits):
            seq.proposal = proposal if len(proposal) else None
            if seq.proposal is None and limit:
                self._speculation_failed(seq)  # nothing to propose (no n-gram match)

    def _launch(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None) -> LaunchedStep:
        """Queue ``batch`` on the executor and start sampling it. An async engine leaves the
        token ids of a step in which some row samples on the device (read later)."""
        step = make_step(batch.to_work(), self.executor.block_size)
        logits = (
            self.executor.execute(step)
            if input_ids is None
            else self.executor.execute(step, input_ids=input_ids)
        )
        if batch.speculative:
            tokens = self._verify(batch, logits)
            return LaunchedStep(batch, None, lambda: tokens)
        if self.async_scheduling and any(batch.samples):
            # Drawn on the device: nothing waits for the step here. A prompt chunk that does
            # not end its prompt takes the argmax, ignored (its request's generator
            # untouched); the next step takes the ids of the rows that sample.
            rows = list(zip(batch.seqs, batch.samples))
            params = [s.params if ok else GREEDY for s, ok in rows]
            generators = [self.generators[s.request_id] if ok else None for s, ok in rows]
            ids = self.sampler.sample_on_device(logits, params, generators)
            return LaunchedStep(batch, ids, self.readback.start(ids))
        sampling = [i for i, s in enumerate(batch.samples) if s]
        tokens: list[int | None] = [None] * len(batch)
        if sampling:
            seqs = [batch.seqs[i] for i in sampling]
            # no gather when all sample
            rows = logits if len(sampling) == len(batch) else logits[sampling]
            generators = [self.generators[s.request_id] for s in seqs]
            picked = self.sampler.sample(rows, [s.params for s in seqs], generators)
            for i, t in zip(sampling, picked):
                tokens[i] = t
        return LaunchedStep(batch, None, lambda: tokens)

    def _verify(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[int | list[int] | None]:
        """The tokens of a step in which some rows verified drafts: those rows get what
        verification emits (`speculative.verify`), the other sampling rows one token each."""
        from trtc.runtime.speculative.verify import verify

        starts = list(
            itertools.accumulate((batch.num_logits(i) for i in range(len(batch))), initial=0)
        )
        tokens: list[int | list[int] | None] = [None] * len(batch)
        plain = [i for i, s in enumerate(batch.samples) if s and not batch.proposals[i]]
        if plain:
            rows = logits[torch.tensor([starts[i] for i in plain], device=logits.device)]
            params = [batch.seqs[i].params for i in plain]
            generators = [self.generators[batch.seqs[i].request_id] for i in plain]
            for i, t in zip(plain, self.sampler.sample(rows, params, generators)):
                tokens[i] = t
        for i, (seq, proposal) in enumerate(zip(batch.seqs, batch.proposals)):
            if proposal:
                rows = logits[starts[i] : starts[i + 1]]
                tokens[i] = verify(rows, proposal, seq.params, self.generators[seq.request_id])
                accepted = len(tokens[i]) - 1
                self.counters.spec_proposed_tokens += len(proposal)
                self.counters.spec_accepted_tokens += accepted
                self.counters.spec_verifications += 1
                if accepted:
                    seq.spec_failures = 0
                else:
                    self._speculation_failed(seq)
        return tokens

    def _complete(
        self, batch: ScheduledBatch, tokens: list[int | list[int] | None]
    ) -> list[RequestOutput]:
        """Advance the sequences of a step that ran by its sampled tokens; their outputs."""
        # A row of a step queued ahead whose sequence stopped (or was aborted) meanwhile is dropped.
        live = [s.status is SequenceStatus.RUNNING for s in batch.seqs]
        tokens = [t if ok else None for ok, t in zip(live, tokens)]
        live = [s for s, ok in zip(batch.seqs, live) if ok]
        # Classified before postprocess advances them: decode = only generated tokens left.
        n_decode = sum(1 for s in live if s.num_computed_tokens >= s.num_prompt_tokens)
        n_prefill = len(live) - n_decode
        self.last_step = StepSummary(
            len(batch),
            batch.num_tokens,
            n_prefill,
            n_decode,
            [s.request_id for s in batch.preempted],
            bool(batch.ahead),
        )
        self.counters.steps += 1
        self.counters.ahead_steps += bool(batch.ahead)
        if n_decode and n_prefill:
            self.counters.mixed_steps += 1
            log.debug(  # counted in /metrics; a line a step at INFO would flood the log
                "mixed step: %d prefill + %d decode sequences, %d tokens",
                n_prefill,
                n_decode,
                batch.num_tokens,
            )
        before = [s.num_output_tokens for s in batch.seqs]
        self.scheduler.postprocess(batch, tokens, self.output_processor.hits_stop_string)
        now = time.monotonic()
        outputs = []
        for seq, token, had in zip(batch.seqs, tokens, before):
            if token is None:
                continue
            self.counters.generation_tokens += seq.num_output_tokens - had
            if self.output_processor.first_token(seq, now):
                self.counters.prompt_tokens += seq.num_prompt_tokens
            if self.proposer is not None:
                (self.proposer.finished if seq.is_finished else self.proposer.verified)(seq)
            outputs.append(self._output(seq))
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        if seq.is_finished:
            self.generators.pop(seq.request_id, None)
        return self.output_processor.output(seq)

    def close(self) -> None:
        """Release what the executor holds outside this process (a tensor-parallel
        executor's worker processes); the engine takes no steps afterwards."""
        self.executor.close()

    # --- state ------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot for metrics, health checks and benchmarks."""
        s, bm = self.scheduler, self.block_manager
        return EngineStats(
            executor=self.executor.name,
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            kv_blocks_total=bm.num_blocks,
            block_size=bm.block_size,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            counters=EngineCounters(**vars(self.counters)),
        )
