"""The engine: scheduler + block manager + executor + sampler + output processor, one `step()`
at a time (nano-vllm's LLMEngine: in-flight batching over the paged KV cache).

A step: drafts are proposed (speculative decoding, `speculative.policy`), the scheduler picks
the step's rows, the `StepRunner` runs them through the executor and draws their tokens, and
the scheduler and output processor advance the requests by those tokens. With async
scheduling the next step is queued on the device before this one's tokens are read."""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from trtc import envs
from trtc.artifact import Artifact
from trtc.runtime.core.block_manager import BlockManager
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
from trtc.runtime.engine.step_runner import LaunchedStep, RowTokens, StepRunner
from trtc.runtime.engine.tokenizer import (
    chat_prompt_ids,
    end_of_turn_ids,
    load_detokenizer,
    load_tokenizer,
    prompt_ids_of,
)
from trtc.runtime.executors import Executor, create_executor, default_num_blocks
from trtc.runtime.speculative.policy import SpeculationPolicy

log = logging.getLogger("trtc.engine")

# The first engine of a process reports the interpreter and imports before it as a phase.
_first_engine = True


def _process_startup() -> tuple[StartupPhases, bool]:
    """A new engine's start-up phases, and whether it is the first of its process (whose
    phases begin with the interpreter and the imports before it)."""
    global _first_engine
    first, _first_engine = _first_engine, False
    phases = StartupPhases()
    if first and (before := seconds_since_process_start()) is not None:
        phases.record("interpreter and imports", before)
    return phases, first


class LLMEngine:
    def __init__(self, artifact: str | Path | Artifact, config: EngineConfig | None = None):
        started = time.perf_counter()
        self.startup, first_in_process = _process_startup()
        before_engine = sum(self.startup.seconds.values())
        self.config = config = config or EngineConfig()
        self.artifact = artifact if isinstance(artifact, Artifact) else Artifact.open(artifact)
        self.manifest = self.artifact.manifest
        self.model_name = self.manifest.name
        self.max_seq_len = self.manifest.limits.max_seq_len
        pending_tokenizer = self._start_tokenizer(first_in_process)
        self.counters = EngineCounters()
        if config.speculative is not None:  # a draft model checks it has the same tokenizer
            self.tokenizer = pending_tokenizer.result()
        # A draft model's executor first: on a GPU the target's pool takes what it leaves.
        proposer = self._make_proposer()
        self.executor = self._make_executor()
        self.startup.update(self.executor.startup)
        with self.startup.phase("tokenizer", "what loading it beside the weights left to wait"):
            self.tokenizer = pending_tokenizer.result()
        if proposer is not None and self.executor.name == "tensorrt":
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
        self.scheduler = self._make_scheduler()
        self.speculation = SpeculationPolicy(
            proposer,
            config.speculative_tokens,
            config.speculative_max_batch,
            self.max_seq_len,
            self.counters,
        )
        self.runner = StepRunner(self.executor, self.speculation, self.scheduler.max_num_seqs)
        self.async_scheduling = self._async_scheduling(config.async_scheduling)
        self._ahead: LaunchedStep | None = None  # queued ahead, its tokens not read yet
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.last_step: StepSummary | None = None
        # What no phase above accounts for: the artifact, pool sizing, scheduler, sampler.
        timed = sum(self.startup.seconds.values()) - before_engine
        self.startup.record("engine", time.perf_counter() - started - timed)
        log.info("engine ready: %s", self.startup.summary())

    # --- construction -----------------------------------------------------------------------
    def _start_tokenizer(self, first_in_process: bool) -> Future:
        """Load the tokenizer on its own thread while the weights are read (file reads,
        hashing and device copies release the GIL). A full one imports transformers, seconds
        that hold the GIL much of the time: an engine given prompts as ids loads a decode-only
        one. The executor's imports are timed meanwhile."""
        tokenizer = ThreadPoolExecutor(1, thread_name_prefix="trtc-tokenizer")
        load = load_detokenizer if self.config.decode_only_tokenizer else load_tokenizer
        pending = tokenizer.submit(load, self.artifact.tokenizer_dir)
        tokenizer.shutdown(wait=False)
        with self.startup.phase("interpreter and imports"):
            from trtc.runtime.executors import torch_executor  # noqa: F401  (onnx, torch ops)
        if first_in_process:  # (what a process imports is its own: said once)
            warn_if_uncompiled(("torch", "onnx"))
        return pending

    def _make_executor(self) -> Executor:
        config, limits = self.config, self.manifest.limits
        on_gpu = config.executor == "cuda" or (
            config.executor == "auto" and torch.cuda.is_available()
        )
        num_blocks = config.num_blocks
        if num_blocks is None and not on_gpu:  # the CUDA executor sizes its pool from GPU memory
            num_blocks = default_num_blocks(
                self.manifest, config.kv_cache_memory, config.max_num_seqs or limits.max_num_seqs
            )
        return create_executor(
            config.executor,
            self.artifact,
            num_blocks,
            config.device,
            defer_graphs=config.defer_graphs,
            use_tuning=config.use_tuning,
        )

    def _make_scheduler(self) -> Scheduler:
        config, limits = self.config, self.manifest.limits
        eos = {self.manifest.tokenizer.eos_token_id, *end_of_turn_ids(self.tokenizer)} - {None}
        buckets = self.executor.step_token_buckets if envs.TRTC_FIT_TOKEN_BUCKETS else ()
        return Scheduler(
            self.block_manager,
            config.max_num_seqs or limits.max_num_seqs,
            config.max_num_batched_tokens or limits.max_num_tokens,
            eos_token_id=eos,
            long_prefill_threshold=config.long_prefill_threshold,
            token_buckets=buckets,
        )

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

    def _make_proposer(self):
        config = self.config
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
        generator = self.runner.new_generator(params)  # before the scheduler holds it
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            raise RequestError(str(e)) from None
        self.runner.add(request_id, generator)
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
        launched = self._take_ahead()
        if launched is None:
            self.speculation.propose(self.scheduler.running)
            batch = self.scheduler.schedule()
            if not len(batch):
                return []
            launched = self.runner.launch(batch, on_device=self.async_scheduling)
        self._ahead = self._queue_ahead(launched)
        return self._complete(launched.batch, launched.tokens())

    def _take_ahead(self) -> LaunchedStep | None:
        """The step queued ahead of the last one, unless every row of it has finished or been
        aborted since."""
        launched, self._ahead = self._ahead, None
        if launched is not None and not launched.batch.has_running():
            return None
        return launched

    def _queue_ahead(self, launched: LaunchedStep) -> LaunchedStep | None:
        """The step after ``launched``, queued on the ids it drew on the device, where the
        scheduler can tell it already (`Scheduler.schedule_ahead`). While speculation is on,
        the next step waits for this one's tokens to propose drafts."""
        if launched.device_tokens is None or self.speculation.active(self.scheduler.running):
            return None
        ahead = self.scheduler.schedule_ahead(launched.batch)
        return None if ahead is None else self.runner.launch_ahead(ahead, launched)

    def _complete(self, batch: ScheduledBatch, tokens: list[RowTokens]) -> list[RequestOutput]:
        """Advance the sequences of a step that ran by its tokens; their outputs."""
        # A row of a step queued ahead whose sequence stopped (or was aborted) meanwhile is dropped.
        live = [row.seq.status is SequenceStatus.RUNNING for row in batch]
        tokens = [t if ok else None for ok, t in zip(live, tokens)]
        self._count_step(batch, [row.seq for row, ok in zip(batch, live) if ok])
        before = [row.seq.num_output_tokens for row in batch]
        self.scheduler.postprocess(batch, tokens, self.output_processor.hits_stop_string)
        now = time.monotonic()
        outputs = []
        for row, token, had in zip(batch, tokens, before):
            if token is None:
                continue
            seq = row.seq
            self.counters.generation_tokens += seq.num_output_tokens - had
            if self.output_processor.first_token(seq, now):
                self.counters.prompt_tokens += seq.num_prompt_tokens
            self.speculation.advanced(seq)
            outputs.append(self._output(seq))
        return outputs

    def _count_step(self, batch: ScheduledBatch, live: list[Sequence]) -> None:
        """The step's summary (`last_step`) and counters, before its sequences advance."""
        # Decode rows: only generated tokens left to compute.
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

    def _output(self, seq: Sequence) -> RequestOutput:
        if seq.is_finished:
            self.runner.drop(seq.request_id)
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
