"""The TensorRT executor: runs an engine of the artifact (``engines/``, the manifest's records)
behind the same ``execute(step) -> logits`` as the torch executor.

* Engines of backend ``tensorrt`` take the paged step contract (`trtc.contract`) as it
  is: the step inputs, and the KV pool bound layer by layer (``kv_cache.{i}`` = ``pool[i]``,
  ``kv_cache_out.{i}`` at the same address: the plugin updates it in place).
* Engines of backend ``tensorrt-rtx`` take the slot contract
  (`trtc.slot_contract`): a contiguous cache row per sequence. The executor
  advertises ``block_size = max_seq_len`` and ``num_blocks = slots``, so the block manager gives
  each sequence exactly one block, and that block id is its slot; `slot_calls` turns a paged
  step into engine calls over contiguous runs of slots.

Before anything is deserialised, `engine_refusal` says why this host cannot run an engine (no
CUDA device, another compute capability, no TensorRT runtime, another TensorRT version): plans
are specific to all four. Work is enqueued on torch's current CUDA stream, so it is ordered with
the sampler's torch work without extra synchronisation.

Not exercised by the test suite beyond the refusals and `slot_calls`: no machine here runs an
engine (full TensorRT cannot be installed; TensorRT-RTX does not run on the lent sm90 GPU).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import numpy as np

from trtc.artifact import Artifact, EngineRecord
from trtc.contract import STEP_INPUTS, TORCH_DTYPES, StepInputs, kv_input_name, kv_pool
from trtc.engines import RUNTIMES, choose_engine, engine_refusal
from trtc.errors import ArtifactError
from trtc.runtime.engine.startup import StartupPhases
from trtc.runtime.executors.base import Executor
from trtc.slot_contract import SlotWork, make_slot_step

log = logging.getLogger("trtc.executor")

# A call pads every row to its longest one. Rows share a call while its padding stays under this
# many tokens (about what one more engine launch costs in host overhead, an estimate).
MAX_PADDING_TOKENS = 64


# --- paged steps on slot engines ------------------------------------------------------------


@dataclass
class SlotCall:
    """One slot-engine call: rows ``first_slot ..`` of the slot caches, one per sequence."""

    first_slot: int
    seqs: list[int]  # the paged step's sequence index of each row
    inputs: dict[str, np.ndarray]  # the slot contract's step inputs (make_slot_step)


def slot_calls(step: StepInputs, num_slots: int, max_seq_len: int) -> list[SlotCall]:
    """A paged step (block size = ``max_seq_len``, so ``block_tables[s, 0]`` is the slot of
    sequence ``s``) as slot-engine calls. A call binds contiguous cache rows, so each covers a
    run of consecutive busy slots and never an idle one (its padding writes could land on another
    sequence's data); a run is split where a row's cache could not take the call's padded width
    (``cache_positions + new_tokens <= max_seq_len``) or where the call's padding would pass
    `MAX_PADDING_TOKENS` (a long prefill chunk is not padded into a run of decode rows)."""
    qsl = step.query_start_loc.tolist()
    context_lens, ids = step.context_lens.tolist(), step.input_ids.tolist()
    logits_rows, tables = step.logits_indices.tolist(), step.block_tables.tolist()
    if len(logits_rows) != len(context_lens):
        raise ValueError(
            f"a slot engine returns logits for one token per sequence; this step asks for "
            f"{len(logits_rows)} rows for {len(context_lens)} sequences"
        )
    rows: dict[int, tuple[int, SlotWork, int]] = {}  # slot -> (sequence, its work, logits offset)
    for s, total in enumerate(context_lens):
        begin, end = qsl[s], qsl[s + 1]
        slot = tables[s][0]
        if end <= begin:
            raise ValueError(f"sequence {s} has no new tokens")
        if not 0 <= slot < num_slots:
            raise ValueError(f"sequence {s}: slot {slot} is outside the engine's {num_slots} slots")
        if slot in rows:
            raise ValueError(f"sequences {rows[slot][0]} and {s} share slot {slot}")
        if total > max_seq_len:
            raise ValueError(
                f"sequence {s}: {total} tokens exceed the engine's max_seq_len {max_seq_len}"
            )
        if not begin <= logits_rows[s] < end:
            raise ValueError(
                f"sequence {s}: logits index {logits_rows[s]} is not one of its tokens"
            )
        rows[slot] = (s, SlotWork(ids[begin:end], total - (end - begin)), logits_rows[s] - begin)

    def joins(group, slot):
        merged = [*group, slot]
        lengths = [len(rows[b][1].new_tokens) for b in merged]
        width = max(lengths)
        return (
            slot == group[-1] + 1
            and all(rows[b][1].num_cached + width <= max_seq_len for b in merged)
            and len(merged) * width - sum(lengths) <= MAX_PADDING_TOKENS
        )

    calls, group = [], []
    for slot in sorted(rows):
        if group and not joins(group, slot):
            calls.append(_call(group, rows, max_seq_len))
            group = []
        group.append(slot)
    if group:
        calls.append(_call(group, rows, max_seq_len))
    return calls


def _call(group: list[int], rows: dict, max_seq_len: int) -> SlotCall:
    inputs = make_slot_step([rows[b][1] for b in group], max_seq_len)
    w = inputs["input_ids"].shape[1]
    inputs["logits_indices"] = np.array([k * w + rows[b][2] for k, b in enumerate(group)], np.int64)
    return SlotCall(group[0], [rows[b][0] for b in group], inputs)


# --- the executor ----------------------------------------------------------------------------


class TensorRTExecutor(Executor):
    name = "tensorrt"

    def __init__(
        self,
        artifact: Artifact,
        num_blocks: int | None = None,
        engine: EngineRecord | None = None,
        memory_fraction: float = 0.9,
    ):
        import torch

        self.startup = StartupPhases()
        self.artifact = artifact
        self.manifest = artifact.manifest  # read on every load and by benchmarks
        if engine is None:
            engine, reasons = choose_engine(self.manifest)
            if engine is None:
                raise ArtifactError(
                    f"{self.artifact.path}: no engine this host can run: " + "; ".join(reasons)
                )
        why = engine_refusal(engine)
        if why:
            raise ArtifactError(
                f"{self.artifact.path}: cannot run engine {engine.target} ({engine.file}): {why}"
            )
        artifact.verify([engine.file])
        self.record = engine
        trt = importlib.import_module(RUNTIMES[engine.backend][0])
        if engine.backend == "tensorrt":
            from trtc.plugins.tensorrt import register_plugins

            register_plugins(trt)  # Python plugins live in this process, not in the plan
        from trtc.plugins.tensorrt.logger import make_logger

        messages: list[str] = []
        self._logger = make_logger(trt, engine.backend, log.warning, messages)
        self._runtime = trt.Runtime(self._logger)
        with self.startup.phase("engine", f"{engine.backend} plan {engine.file}"):
            plan = artifact.file(engine.file).read_bytes()
            self.engine = self._runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise ArtifactError(
                f"{self.artifact.path}: {engine.backend} could not load {engine.file}: "
                + ("; ".join(messages) or "no message")
            )
        self.context = self.engine.create_execution_context()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.vocab_size = self.manifest.model.vocab_size
        self.slots = engine.kv_layout == "slot"
        if self.slots:
            self._init_slots(num_blocks)
        else:
            self._init_paged(num_blocks, memory_fraction)
        log.info(
            "executor tensorrt: engine %s (%s %s), %d blocks of %d tokens",
            engine.target,
            engine.backend,
            engine.trt_version,
            self.num_blocks,
            self.block_size,
        )

    def _init_paged(self, num_blocks: int | None, memory_fraction: float) -> None:

        kv = self.manifest.kv_cache
        self.block_size = kv.block_size
        most = self.record.profile[kv_input_name(0)]["max"][1]  # the engine's num_blocks range
        if num_blocks is None:
            from trtc.runtime.executors.kv_pool_sizing import (
                blocks_for_memory,
            )  # the plan holds the weights

            num_blocks = blocks_for_memory(
                self.manifest, memory_fraction, self.device, self.record.bytes
            )
        if num_blocks > most:
            log.info(
                "executor tensorrt: %d KV blocks asked for, the engine takes at most %d",
                num_blocks,
                most,
            )
            num_blocks = most
        self.num_blocks = num_blocks
        self.kv_pool = kv_pool(kv, num_blocks, self.device)
        self.layer_inputs = {kv_input_name(i): self.kv_pool[i] for i in range(kv.num_layers)}
        self.aliases = self.record.aliases

    def _init_slots(self, num_blocks: int | None) -> None:
        import torch

        contract = self.record.contract
        cache = contract["kv_cache"]
        self.max_seq_len = cache["max_seq_len"]
        self.block_size = self.max_seq_len  # one block per sequence: its block id is its slot
        self.num_blocks = self.record.profile["input_ids"]["max"][0]
        if num_blocks is not None and num_blocks != self.num_blocks:
            log.info(
                "executor tensorrt: a slot engine has %d slots; ignoring num_blocks=%d",
                self.num_blocks,
                num_blocks,
            )
        shape = (self.num_blocks, *cache["shape"][1:])
        self.aliases = contract["aliases"]
        # Zeroed: masked rows are multiplied by zero weights, and 0 * NaN would be NaN.
        self.layer_inputs = {
            name: torch.zeros(shape, dtype=TORCH_DTYPES[cache["dtype"]], device=self.device)
            for name in self.aliases.values()
        }

    def _run(self, inputs: dict, outputs: dict) -> None:
        import torch

        for name, t in inputs.items():
            if not self.context.set_input_shape(name, tuple(t.shape)):
                raise RuntimeError(
                    f"engine {self.record.target}: {name} of shape {list(t.shape)} is outside "
                    f"its optimization profile {self.record.profile.get(name)}"
                )
            self.context.set_tensor_address(name, t.data_ptr())
        for out, src in self.aliases.items():  # updated caches alias their inputs: same address
            self.context.set_tensor_address(out, inputs[src].data_ptr())
        for name, t in outputs.items():
            self.context.set_tensor_address(name, t.data_ptr())
        if not self.context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise RuntimeError(
                f"engine {self.record.target}: execution failed (see the warnings above)"
            )

    def execute(self, step: StepInputs, input_ids=None):
        """Logits ``[len(logits_indices), vocab]`` fp32 on the GPU; the KV cache is updated in
        place. (No ``input_ids`` on the device: `takes_device_input_ids` is False.)"""
        import torch

        if input_ids is not None:
            raise ValueError("the tensorrt executor takes a step's input ids from the step only")

        if self.slots:
            return self._execute_slots(step)
        feeds = {
            name: getattr(step, name)
            .to(self.device, getattr(torch, dtype), non_blocking=True)
            .contiguous()
            for name, (dtype, _, _) in STEP_INPUTS.items()
        }
        logits = torch.empty(
            feeds["logits_indices"].shape[0],
            self.vocab_size,
            dtype=torch.float32,
            device=self.device,
        )
        self._run(feeds | self.layer_inputs, {"logits": logits})
        return logits

    def _execute_slots(self, step: StepInputs):
        import torch

        logits = torch.empty(
            step.context_lens.shape[0], self.vocab_size, dtype=torch.float32, device=self.device
        )
        for call in slot_calls(step, self.num_blocks, self.max_seq_len):
            rows = slice(call.first_slot, call.first_slot + len(call.seqs))
            feeds = {k: torch.from_numpy(v).to(self.device) for k, v in call.inputs.items()}
            caches = {name: buf[rows] for name, buf in self.layer_inputs.items()}  # contiguous rows
            out = torch.empty(
                len(call.seqs), self.vocab_size, dtype=torch.float32, device=self.device
            )
            self._run(feeds | caches, {"logits": out})
            logits.index_copy_(0, torch.tensor(call.seqs, device=self.device), out)
        return logits
