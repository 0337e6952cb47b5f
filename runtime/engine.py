"""The engine: scheduler + block manager + executor + sampler + detokenizer, one `step()` at a
time (nano-vllm's LLMEngine, in-flight batching over the paged KV cache). `LLM` on top of it is
the offline API users know from vLLM."""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trtc.compiler.artifact import read_manifest
from trtc.runtime.block_manager import BlockManager
from trtc.runtime.detokenizer import IncrementalDetokenizer
from trtc.runtime.executor import create_executor, default_num_blocks
from trtc.runtime.sampler import Sampler, make_generator
from trtc.runtime.scheduler import ScheduledBatch, Scheduler
from trtc.runtime.sequence import SamplingParams, Sequence, SequenceStatus
from trtc.runtime.step import make_step
from trtc.runtime.token_readback import LaunchedStep, TokenReadback

log = logging.getLogger("trtc.engine")


class RequestError(ValueError):
    """A request the engine cannot take (too long, bad parameters); the message says why."""


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]               # generated so far
    text: str                          # generated text so far (stop string excluded)
    new_token_ids: list[int]           # since the previous output of this request
    delta_text: str
    finished: bool = False
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    num_cached_tokens: int = 0         # prompt tokens served by the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class EngineConfig:
    executor: str = "auto"             # auto | torch | cuda | tensorrt (see executor.py)
    device: str = "cpu"
    num_blocks: int | None = None      # KV blocks in the pool (default: from kv_cache_memory)
    kv_cache_memory: int = 1 << 30     # bytes for the KV pool when num_blocks is not given
    max_num_seqs: int | None = None    # default: the artifact's limits
    max_num_batched_tokens: int | None = None
    long_prefill_threshold: int = 0
    enable_prefix_caching: bool = True
    # Queue step n+1 on the device before reading step n's tokens (decode steps; see
    # `LLMEngine.step`). None: on for the CUDA executor unless TRTC_ASYNC_SCHEDULING=0.
    async_scheduling: bool | None = None


@dataclass
class _Detok:
    """Output state of one request: its text so far and what has been handed out."""
    text: IncrementalDetokenizer
    sent_tokens: int = 0
    sent_text: int = 0
    first_token_time: float | None = None
    stopped: bool = False


class LLMEngine:
    def __init__(self, artifact_dir: str | Path, config: EngineConfig | None = None):
        from transformers import AutoTokenizer
        self.config = config = config or EngineConfig()
        self.artifact_dir = Path(artifact_dir)
        self.manifest = read_manifest(self.artifact_dir)
        limits = self.manifest["limits"]
        self.model_name = self.manifest["name"]
        self.max_seq_len = limits["max_seq_len"]
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.artifact_dir / "tokenizer"))
        on_gpu = config.executor == "cuda" or (config.executor == "auto" and torch.cuda.is_available())
        num_blocks = config.num_blocks
        if num_blocks is None and not on_gpu:      # the CUDA executor sizes its pool from GPU memory
            num_blocks = default_num_blocks(self.manifest, config.kv_cache_memory,
                                            config.max_num_seqs or limits["max_num_seqs"])
        self.executor = create_executor(config.executor, self.artifact_dir, num_blocks, config.device)
        self.block_manager = BlockManager(self.executor.num_blocks, self.executor.block_size,
                                          config.enable_prefix_caching)
        eos = {self.manifest["tokenizer"]["eos_token_id"], *self._generation_eos()} - {None}
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs or limits["max_num_seqs"],
            config.max_num_batched_tokens or limits["max_num_tokens"], eos_token_id=eos,
            long_prefill_threshold=config.long_prefill_threshold)
        self.sampler = Sampler()
        self.async_scheduling = self._async_scheduling(config.async_scheduling)
        # Where logits, sampled ids and the seeded requests' generators live.
        self.device = getattr(self.executor, "device", torch.device("cpu"))
        self.readback = TokenReadback(self.device, self.scheduler.max_num_seqs)
        self._ahead: LaunchedStep | None = None    # queued ahead, its tokens not read yet
        self.generators: dict[str, torch.Generator | None] = {}
        self.detok: dict[str, _Detok] = {}
        self._ids = itertools.count()
        self.stats = {"steps": 0, "mixed_steps": 0, "ahead_steps": 0, "prompt_tokens": 0,
                      "generation_tokens": 0}
        self.last_step: dict = {}

    def _async_scheduling(self, wanted: bool | None) -> bool:
        able = getattr(self.executor, "takes_device_input_ids", False)
        if wanted is None:
            return able and self.executor.name == "cuda" and os.environ.get("TRTC_ASYNC_SCHEDULING", "1") != "0"
        if wanted and not able:
            raise ValueError(f"async scheduling needs an executor that takes input ids on its device; "
                             f"the {self.executor.name} executor does not (use the cuda or torch executor)")
        return wanted

    def _generation_eos(self) -> set[int]:
        ids = set()
        for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid >= 0:
                ids.add(tid)
        return ids

    # --- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return list(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            params.validate()
        except ValueError as e:
            raise RequestError(str(e)) from None
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        vocab = self.manifest["model"]["vocab_size"]
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_seq_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_seq_len} tokens, but "
                f"{total} were requested ({len(prompt_ids)} in the prompt, {params.max_tokens} "
                f"for the completion); shorten the prompt or lower max_tokens")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prompt_ids: list[int] | None = None) -> str:
        params = params or SamplingParams()
        prompt_ids = prompt_ids if prompt_ids is not None else self.tokenize(prompt)
        self.check_request(prompt_ids, params)
        request_id = request_id or self.new_request_id()
        seq = Sequence(request_id, prompt_ids, params)
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            raise RequestError(str(e)) from None
        self.generators[request_id] = make_generator(params, self.device)
        self.detok[request_id] = _Detok(IncrementalDetokenizer(self.tokenizer))
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and return its outputs.

        With async scheduling, the step after this one is queued on the device before this
        one's tokens are read (`Scheduler.schedule_ahead`; its input tokens go from this step's
        argmax to its inputs on the device), so the host's scheduling, input preparation and
        output handling overlap the GPU instead of leaving it idle between steps (tokens are
        drawn on the device, seeded requests from their own generator there). Only pure
        continuations go ahead: a step that admits, preempts or finishes every row waits."""
        launched, self._ahead = self._ahead, None
        if launched is not None and not launched.batch.has_running():
            launched = None                 # every row finished or was aborted since it was queued
        if launched is None:
            batch = self.scheduler.schedule()
            if not len(batch):
                return []
            launched = self._launch(batch)
        if launched.device_tokens is not None:
            ahead = self.scheduler.schedule_ahead(launched.batch)
            if ahead is not None:
                self._ahead = self._launch(ahead, input_ids=launched.device_tokens)
        return self._complete(launched.batch, launched.tokens())

    def _launch(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None) -> LaunchedStep:
        """Queue ``batch`` on the executor and start sampling it. An async engine leaves the
        token ids of a step whose every row samples on the device (read later)."""
        step = make_step(batch.to_work(), self.executor.block_size)
        logits = (self.executor.execute(step) if input_ids is None
                  else self.executor.execute(step, input_ids=input_ids))
        sampling = [i for i, s in enumerate(batch.samples) if s]
        seqs = [batch.seqs[i] for i in sampling]
        generators = [self.generators[s.request_id] for s in seqs]
        if self.async_scheduling and len(sampling) == len(batch):
            ids = self.sampler.sample_on_device(logits, [s.params for s in seqs], generators)
            return LaunchedStep(batch, ids, self.readback.start(ids))
        tokens: list[int | None] = [None] * len(batch)
        if sampling:
            rows = logits if len(sampling) == len(batch) else logits[sampling]   # no gather when all sample
            picked = self.sampler.sample(rows, [s.params for s in seqs], generators)
            for i, t in zip(sampling, picked):
                tokens[i] = t
        return LaunchedStep(batch, None, lambda: tokens)

    def _complete(self, batch: ScheduledBatch, tokens: list[int | None]) -> list[RequestOutput]:
        """Advance the sequences of a step that ran by its sampled tokens; their outputs."""
        # A row of a step queued ahead whose sequence stopped (or was aborted) meanwhile is dropped.
        live = [s.status is SequenceStatus.RUNNING for s in batch.seqs]
        tokens = [t if ok else None for ok, t in zip(live, tokens)]
        live = [s for s, ok in zip(batch.seqs, live) if ok]
        # Classified before postprocess advances them: decode = only generated tokens left.
        n_decode = sum(1 for s in live if s.num_computed_tokens >= s.num_prompt_tokens)
        n_prefill = len(live) - n_decode
        self.last_step = {"num_seqs": len(batch), "num_tokens": batch.num_tokens,
                          "prefill_seqs": n_prefill, "decode_seqs": n_decode,
                          "preempted": [s.request_id for s in batch.preempted],
                          "ahead": batch.ahead}
        self.stats["steps"] += 1
        self.stats["ahead_steps"] += batch.ahead
        if n_decode and n_prefill:
            self.stats["mixed_steps"] += 1
            log.info("mixed step: %d prefill + %d decode sequences, %d tokens",
                     n_prefill, n_decode, batch.num_tokens)
        self.scheduler.postprocess(batch, tokens)
        now = time.monotonic()
        outputs = []
        for seq, token in zip(batch.seqs, tokens):
            if token is None:
                continue
            self.stats["generation_tokens"] += 1
            state = self.detok[seq.request_id]
            if state.first_token_time is None:
                state.first_token_time = now
                self.stats["prompt_tokens"] += seq.num_prompt_tokens
            self._match_stop(seq, state)
            outputs.append(self._output(seq))
        return outputs

    def _match_stop(self, seq: Sequence, state: _Detok) -> None:
        """Extend the text by the new token and finish the request on a stop string (the text
        is cut before it, as OpenAI's API does)."""
        if not (seq.params.detokenize or seq.params.stop):
            return
        delta = state.text.update(seq.output_token_ids)
        if not delta:
            return
        text = state.text.text
        for stop in seq.params.stop:
            at = text.find(stop, max(0, len(text) - len(delta) - len(stop) + 1))
            if at >= 0:
                state.text.text = text[:at]
                state.stopped = True
                self.scheduler.finish(seq, "stop")
                return

    def _output(self, seq: Sequence) -> RequestOutput:
        state = self.detok[seq.request_id]
        finished = seq.is_finished
        if (finished and not state.stopped and seq.finish_reason != "abort"
                and (seq.params.detokenize or seq.params.stop)):
            # Bytes still waiting for the rest of a character are flushed as they are.
            state.text.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        text = state.text.text
        delta = text[state.sent_text:]
        new_ids = seq.output_token_ids[state.sent_tokens:]
        state.sent_text, state.sent_tokens = len(text), seq.num_output_tokens
        out = RequestOutput(seq.request_id, seq.token_ids[:seq.num_prompt_tokens],
                            list(seq.output_token_ids), text, new_ids, delta, finished,
                            seq.finish_reason, seq.num_cached_prefix_tokens, seq.arrival_time,
                            state.first_token_time, time.monotonic() if finished else None)
        if finished:
            self.generators.pop(seq.request_id, None)
            self.detok.pop(seq.request_id, None)
        return out

    # --- metrics ----------------------------------------------------------------------------
    def kv_blocks_used(self) -> int:
        return self.block_manager.num_blocks - self.block_manager.num_free_blocks


class LLM:
    """Offline API: ``LLM(artifact).generate(prompts, SamplingParams(...))``."""

    def __init__(self, artifact_dir: str | Path, **engine_kwargs):
        self.engine = LLMEngine(artifact_dir, EngineConfig(**engine_kwargs))

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.engine.apply_chat_template(messages)], params)[0]
