"""The CUDA executor: the torch executor on a GPU, with the KV pool preallocated from a memory
fraction and steps replayed from CUDA graphs (a decode step run eagerly is mostly host overhead
on a small model: a few hundred kernel launches from Python).

- Decode steps: a graph per batch size; a step of ``n`` sequences replays the smallest captured
  size ``>= n``; the extra rows are padding (slot -1, so nothing is written; one visible cached
  position, so nothing divides by zero) and their logits are dropped.
- Steps of a few tokens a sequence (speculative verification): a graph per (batch, tokens)
  bucket, captured on first use, each sequence padded to its bucket's tokens
  (`MultiTokenInputs`).
- Prefill and mixed prefill + decode steps: a graph per token bucket (`MIXED_TOKEN_BUCKETS`)
  over every sequence a step may run and one more: the step's tokens are followed by one
  padding sequence that takes the bucket's remaining tokens, and the sequences after it have
  none (`MixedStepInputs`). The attention kernels' launch depends on shapes only, so one graph
  serves every step of its bucket. Run eagerly, such a step waits for its kernels to be queued
  from Python, several times as long as a decode step of as many sequences (BENCHMARKS.md,
  2026-12-06). ``TRTC_MIXED_GRAPHS=0`` (or ``mixed_graphs=False``) runs them eagerly. Longer
  steps, and steps asking for more logits rows than the graphs' sequences, run eagerly.

The decode and prefill / mixed-step graphs are captured at start; a server's
(``defer_graphs``, `EngineConfig.defer_graphs`) captures only the one-sequence decode graph and
the smallest prefill / mixed-step one before it is ready and the others a piece at a time after
(`capture_deferred`), so a replica is ready sooner; a step whose graph is not there yet replays
a larger one or runs eagerly (`trtc tune` ships the kernels of the eager launches too)."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import numpy as np
import torch

from trtc import envs
from trtc.artifact import Artifact, Limits, Manifest
from trtc.contract import SequenceWork, StepInputs, make_step
from trtc.runtime.engine.startup import StartupPhases
from trtc.runtime.executors.fusions import RUNTIME_OPS, fuse
from trtc.runtime.executors.fusions.int4_fragment import int4_fragment_bytes
from trtc.runtime.executors.graph import GraphNode
from trtc.runtime.executors.torch_executor import TorchExecutor, with_device_ids
from trtc.runtime.executors.torch_ops import ONNX_OPS
from trtc.runtime.executors.tuning import apply as apply_tuning
from trtc.runtime.executors.tuning import load_tuning

log = logging.getLogger("trtc.executor")

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Tokens per sequence of the multi-token steps captured as graphs (a sequence verifying K
# drafts runs K + 1: K = 1, 2, 4, 8), each sequence's tokens padded to the bucket.
MULTI_TOKEN_BUCKETS = (2, 3, 5, 9)
# Only for steps of few sequences (speculation's, by its off-rule): a graph's logits cover every
# padded token, and a wide one would take memory the KV pool was sized without.
MULTI_TOKEN_MAX_SEQS = 16
# Token counts of the prefill / mixed-step graphs (those above the largest decode batch and at
# most the artifact's step limit are captured): a step runs in the smallest bucket that holds
# it, so padding costs at most a third of its tokens above 128.
MIXED_TOKEN_BUCKETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
# The longest step the start-up warm-up runs (see `CudaExecutor.warm_up`): the activations of a
# step this long stay in the caching allocator, within the 1 GiB the KV pool is sized around.
WARM_UP_TOKENS = 2048


def blocks_for_memory(
    manifest: Manifest, memory_fraction: float, device: torch.device, weight_bytes: int
) -> int:
    """KV blocks that fit in ``memory_fraction`` of the GPU, after the weights and a margin for
    activations."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * memory_fraction) - (total - free) - weight_bytes - (1 << 30)
    blocks = budget // manifest.kv_cache.bytes_per_block
    if blocks < 1:
        raise RuntimeError(
            f"no GPU memory left for the KV cache ({budget / 2**30:.1f} GiB after the weights)"
        )
    return int(blocks)


def decode_graph_sizes(limits: Limits, max_graph_batch: int | None = None) -> list[int]:
    """The batch sizes decode graphs are captured for: `GRAPH_BATCH_SIZES` up to the largest
    (``max_graph_batch``, at most the artifact's ``max_num_seqs``), which is always one."""
    top = min(max_graph_batch or limits.max_num_seqs, limits.max_num_seqs)
    sizes = [b for b in GRAPH_BATCH_SIZES if b <= top] or [1]
    return sizes if sizes[-1] == top else [*sizes, top]


def mixed_graph_seqs(decode_batch: int) -> int:
    """The sequences of a prefill / mixed-step graph: every sequence a step may run (the
    largest decode batch) and the padding one (`MixedStepInputs`). A step at full concurrency
    (a new prompt's chunk beside every other running sequence's token) is the common one."""
    return decode_batch + 1


def mixed_token_buckets(limits: Limits, seqs: int) -> list[int]:
    """The token buckets of the prefill / mixed-step graphs over ``seqs`` sequences: more
    tokens than sequences (a prefill launch), at most a step's and a context's."""
    top = min(limits.max_num_tokens, limits.max_seq_len)
    return [t for t in MIXED_TOKEN_BUCKETS if seqs < t <= top]


def mixed_graph_bytes(manifest: Manifest, tokens: int, seqs: int) -> int:
    """About what the prefill / mixed-step graphs hold on top of the eager margin: their
    shared pool (the largest bucket's activations: a layer's gate and up projections and their
    product, the residual stream, normed and attention copies, per token) and their shared
    ``[seqs, vocab]`` fp32 logits (and the half-precision logits they are made from)."""
    g = manifest.model
    element = 4 if manifest.precision == "fp32" else 2
    activations = tokens * (3 * g.intermediate_size + 6 * g.hidden_size) * element
    return activations + seqs * g.vocab_size * (4 + element)


class CudaExecutor(TorchExecutor):
    name = "cuda"
    ops = {**ONNX_OPS, **RUNTIME_OPS}

    def __init__(
        self,
        artifact: Artifact,
        num_blocks: int | None = None,
        device: str = "cuda",
        memory_fraction: float = 0.9,
        max_graph_batch: int | None = None,
        use_cuda_graphs: bool = True,
        fuse_kernels: bool = True,
        int4_fragments: bool | None = None,
        rank: int = 0,
        use_tuning: bool = True,
        mixed_graphs: bool | None = None,
        defer_graphs: bool = False,
    ):
        self.startup = StartupPhases()
        with self.startup.phase("cuda context"):
            torch.cuda.init()
            torch.empty(1, device=device)  # the context and the caching allocator
        # Before anything launches a Triton kernel: a tuned artifact's kernels and choices.
        with self.startup.phase("tuning"):
            use_tuning = use_tuning and envs.TRTC_TUNING
            self.tuning = load_tuning(artifact, torch.device(device)) if use_tuning else None
            if self.tuning is not None:
                apply_tuning(self.tuning)
        self.fuse_kernels = fuse_kernels
        # The INT4 Linears held in the fragment layout instead of the plugin's
        # (fusions/int4_fragment.py): faster decode steps, prefill through a dequantized
        # transient weight; TRTC_INT4_FRAGMENTS=0 (or int4_fragments=False) keeps them as stored.
        if int4_fragments is None:
            int4_fragments = envs.TRTC_INT4_FRAGMENTS
        self.int4_fragments = int4_fragments and fuse_kernels
        self.fusions: dict[str, int] = {}
        manifest = artifact.manifest
        limits = manifest.limits
        self.graph_sizes = decode_graph_sizes(limits, max_graph_batch)
        if mixed_graphs is None:
            mixed_graphs = envs.TRTC_MIXED_GRAPHS
        mixed_graphs = mixed_graphs and use_cuda_graphs
        self.mixed_seqs = mixed_graph_seqs(self.graph_sizes[-1])
        self.mixed_sizes = mixed_token_buckets(limits, self.mixed_seqs) if mixed_graphs else []
        if num_blocks is None:
            num_blocks = self.pool_blocks(
                manifest, device, memory_fraction, self.int4_fragments, mixed_graphs
            )
        super().__init__(artifact, num_blocks, device, rank, startup=self.startup)
        self.max_blocks_per_seq = -(-limits.max_seq_len // self.block_size)
        # Decode steps: batch -> (graph, inputs, logits), captured at start, or with
        # ``defer_graphs`` only the smallest, the rest after it (`capture_deferred`).
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, DecodeInputs, torch.Tensor]] = {}
        self._graph_batches: list[int] = []  # the batches of graphs, ascending
        self._decode_pool = None
        # Steps of up to MULTI_TOKEN_BUCKETS[-1] tokens a sequence (speculative verification,
        # short chunks), captured the first time a shape is met: (batch, tokens) -> graph.
        self.multi_graphs: dict[tuple[int, int], tuple] = {}
        self._multi_pool = None
        # Prefill and mixed steps: tokens -> (graph, inputs), captured at start, or with
        # ``defer_graphs`` after it.
        self.mixed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, MixedStepInputs]] = {}
        self._mixed_captured: list[int] = []  # the buckets of mixed_graphs, ascending
        self._mixed_pool = None
        self.mixed_logits: torch.Tensor | None = None
        # Graphs still to capture, in order: ("decode", batch) or ("mixed", tokens); and the
        # one whose warm-up has run, to be captured next (`capture_deferred`).
        self._to_capture: list[tuple[str, int]] = []
        self._warmed: tuple | None = None
        # Host seconds of those pieces: in all, and the longest (what a request arriving
        # meanwhile may wait), reported when the last is done.
        self._pieces_s, self._longest_piece_s = 0.0, 0.0
        with self.startup.phase(
            "kernels",
            "loaded from the artifact's tuning" if self.tuning else "compiled (not tuned here)",
        ):
            self.warm_up()
        if use_cuda_graphs:
            with self.startup.phase("graphs") as phases:
                reserved = torch.cuda.memory_reserved(self.device)
                if defer_graphs:
                    # Now: the one-sequence decode graph and the smallest prefill / mixed-step
                    # one, which also runs decode steps of any batch (their tokens fit): until
                    # the rest are captured, short prompts and every decode step replay a graph.
                    self._plan_captures(mixed=True)
                    first = [("decode", self.graph_sizes[0])]
                    first += [("mixed", self.mixed_sizes[0])] if self.mixed_sizes else []
                    for kind, size in first:
                        self._to_capture.remove((kind, size))
                        self._capture_one(kind, size)
                else:
                    self.capture_graphs()
                # (A capture empties the allocator's cache first: what the warm-up left there
                # can outweigh a small graph's pool.)
                held = torch.cuda.memory_reserved(self.device) - reserved
                later = f", {len(self._to_capture)} after ready" if self._to_capture else ""
                size = f", {held / 2**20:.0f} MiB" if held > 0 else ""
                phases.note(
                    "graphs",
                    f"{len(self.graph_sizes)} decode batch sizes, {len(self.mixed_sizes)} "
                    f"prefill / mixed token buckets{later}{size}",
                )

    @staticmethod
    def pool_blocks(
        manifest: Manifest,
        device: str | torch.device = "cuda",
        memory_fraction: float = 0.9,
        int4_fragments: bool = True,
        mixed_graphs: bool = True,
    ) -> int:
        """The KV blocks a pool on ``device`` gets by default: what ``memory_fraction`` of
        the GPU holds after the weights (and their fragment-layout copies) and, with
        ``mixed_graphs``, what the prefill / mixed-step graphs hold."""
        weight_bytes = manifest.graph.weight_bytes["total"]
        if int4_fragments:
            weight_bytes += int4_fragment_bytes(manifest)
        seqs = mixed_graph_seqs(decode_graph_sizes(manifest.limits)[-1])
        buckets = mixed_token_buckets(manifest.limits, seqs) if mixed_graphs else []
        if buckets:
            weight_bytes += mixed_graph_bytes(manifest, buckets[-1], seqs)
        return blocks_for_memory(manifest, memory_fraction, torch.device(device), weight_bytes)

    def rewrite(self, graph: list[GraphNode]) -> list[GraphNode]:
        """Fewer, fused kernels (`fusions/`); ``fuse_kernels=False`` runs the graph as
        compiled; ``int4_fragments=False`` keeps Int4Gemm on the plugin-layout kernels only."""
        if not self.fuse_kernels:
            return graph
        graph, counts = fuse(graph, self.constants, self.graph_outputs, self.int4_fragments)
        self.fusions = dict(counts)
        log.info("fused kernels: %s", ", ".join(f"{k} x{v}" for k, v in counts.items()))
        return graph

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run a prefill step and a mixed prefill + decode step eagerly, so the kernels of
        those paths are compiled (or loaded from a tuned artifact's kernels) before the first
        request instead of during it; then one prefill step as long as a step may be (up to
        `WARM_UP_TOKENS`), so the caching allocator holds the activations of the largest step
        from the start rather than growing (each cudaMalloc waits for the GPU) under load.
        Writes KV only into the first blocks, before any sequence owns them."""
        per_block = self.block_size
        blocks = list(range(min(self.num_blocks, -(-48 // per_block))))
        if len(blocks) * per_block < 48:
            return  # a pool this small is a test's: nothing to gain
        prompt = list(range(1, 33))
        steps = [
            [SequenceWork(prompt, 0, blocks)],
            [SequenceWork(prompt[:15], 32, blocks), SequenceWork([7], 16, blocks)],
        ]
        limits = self.manifest.limits
        longest = min(
            limits.max_num_tokens,
            limits.max_seq_len,
            WARM_UP_TOKENS,
            self.num_blocks * per_block,
            self.max_blocks_per_seq * per_block,
        )
        if longest > 32:
            table = list(range(-(-longest // per_block)))
            steps.append([SequenceWork([(i % 97) + 1 for i in range(longest)], 0, table)])
        for work in steps:
            self.forward(make_step(work, per_block).to(self.device).as_dict())
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def capture_graphs(self, mixed: bool = True) -> None:
        """Capture (again) a decode graph per batch size and, with ``mixed``, a prefill /
        mixed-step graph per token bucket, with the kernels' launch settings as they are now
        (`trtc tune`'s A/B of programmatic dependent launch and the GEMV recaptures the decode
        graphs it times, then everything with the winners)."""
        self._plan_captures(mixed)
        while self.capture_deferred():
            pass

    def _plan_captures(self, mixed: bool) -> None:
        """Drop the decode graphs (and, with ``mixed``, the prefill / mixed-step ones) and list
        them for capture: decode first, each kind largest first, into one memory pool per kind
        (smaller graphs reuse the largest's memory: one step runs at a time, and its logits
        are sampled before the next is queued). The mixed-step graphs all write their logits
        into one buffer (`mixed_logits`): one ``[seqs, vocab]`` block, not one a bucket."""
        torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self._graph_batches, self._decode_pool = [], None
        pending = [(w[0], w[1])] if (w := self._warmed) is not None else []
        self._warmed = None
        plan = [("decode", b) for b in sorted(self.graph_sizes, reverse=True)]
        if mixed:
            self.mixed_graphs.clear()
            self._mixed_captured, self._mixed_pool = [], None
            plan += [("mixed", t) for t in sorted(self.mixed_sizes, reverse=True)]
        else:  # the mixed-step graphs still to capture stay in the plan
            plan += [p for p in pending + self._to_capture if p[0] == "mixed"]
        self._to_capture = plan

    @torch.inference_mode()
    def capture_deferred(self) -> bool:
        """Do the next piece of capturing the graphs still to capture: a graph's warm-up run,
        then its capture (each a few milliseconds of host time, so that a step that comes
        meanwhile waits for one piece at most); True while some are left. Until a step's graph
        is there, the step runs in the smallest captured graph that holds it, or eagerly."""
        if self._warmed is None and not self._to_capture:
            return False
        started = time.perf_counter()
        if self._warmed is not None:
            self._record_one(*self._warmed)
            self._warmed = None
        else:
            kind, size = self._to_capture.pop(0)
            inputs = self._graph_inputs(kind, size)
            self._warm(inputs.tensors)
            self._warmed = (kind, size, inputs)
        piece = time.perf_counter() - started
        self._pieces_s += piece
        self._longest_piece_s = max(self._longest_piece_s, piece)
        if self._warmed is None and not self._to_capture:
            log.info(
                "graphs: decode batches %s, prefill / mixed-step tokens %s (after ready: "
                "%.2f s in pieces, the longest %.1f ms)",
                self._graph_batches,
                self._mixed_captured,
                self._pieces_s,
                1000 * self._longest_piece_s,
            )
            return False
        return True

    @contextmanager
    def graphs_set_aside(self):
        """Run every step eagerly meanwhile, as a server's steps run before their graphs are
        captured (``defer_graphs``) and as steps beyond the graphs always do: `trtc tune` runs
        its serving shapes so too, so that the kernels of those launches ship as well."""
        batches, buckets = self._graph_batches, self._mixed_captured
        self._graph_batches, self._mixed_captured = [], []
        try:
            yield
        finally:
            self._graph_batches, self._mixed_captured = batches, buckets

    def _capture_one(self, kind: str, size: int) -> None:
        inputs = self._graph_inputs(kind, size)
        self._warm(inputs.tensors)
        self._record_one(kind, size, inputs)

    def _graph_inputs(self, kind: str, size: int) -> DecodeInputs | MixedStepInputs:
        if kind == "decode":
            return DecodeInputs(size, self.max_blocks_per_seq, self.device)
        if self.mixed_logits is None:  # one buffer every mixed-step graph writes its logits to
            seqs, vocab = self.mixed_seqs, self.manifest.model.vocab_size
            self.mixed_logits = torch.empty(seqs, vocab, dtype=torch.float32, device=self.device)
        return MixedStepInputs(
            size, self.mixed_seqs, self.max_blocks_per_seq, self.block_size, self.device
        )

    def _record_one(self, kind: str, size: int, inputs) -> None:
        """Capture the warmed graph of ``kind`` and ``size`` into its kind's memory pool."""
        if kind == "decode":
            graph, logits = self._record(inputs.tensors, self._decode_pool)
            self._decode_pool = graph.pool()
            self.graphs[size] = (graph, inputs, logits)
            self._graph_batches = sorted(self.graphs)
        else:
            graph, _ = self._record(inputs.tensors, self._mixed_pool, out=self.mixed_logits)
            self._mixed_pool = graph.pool()
            self.mixed_graphs[size] = (graph, inputs)
            self._mixed_captured = sorted(self.mixed_graphs)
        torch.cuda.synchronize(self.device)

    def _replay_mixed(self, step: StepInputs, input_ids: torch.Tensor | None):
        """A prefill or mixed step from the graph of the smallest token bucket that holds it
        and one padding sequence; None when none does (then it runs eagerly)."""
        tokens = next((t for t in self._mixed_captured if t >= step.num_tokens), None)
        if tokens is None:
            return None
        graph, inputs = self.mixed_graphs[tokens]
        if not inputs.fits(step):
            return None
        rows = inputs.load(step)
        if input_ids is not None:
            inputs.tensors["input_ids"][: len(input_ids)].copy_(input_ids)
        graph.replay()
        return self.mixed_logits[:rows]

    def _capture(
        self, tensors: dict, pool, out: torch.Tensor | None = None
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The step graph on static ``tensors`` as a CUDA graph (memory from ``pool``), after
        a warm-up run; with ``out``, the graph copies its logits into it (a buffer graphs share)
        and returns it."""
        self._warm(tensors)
        return self._record(tensors, pool, out)

    def _warm(self, tensors: dict) -> None:
        """Run the step once on a side stream before its capture: the kernels of its shapes
        are compiled or loaded (a Triton kernel specializes on some of them) outside it."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.forward(tensors)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _record(
        self, tensors: dict, pool, out: torch.Tensor | None = None
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.forward(tensors)
            if out is not None:
                logits = out.copy_(logits)
        return graph, logits

    @property
    def step_token_buckets(self) -> list[int]:
        """The token counts a prefill or mixed step is padded up to (the mixed-step graphs';
        longer steps run eagerly, as they are). The scheduler fits steps to them."""
        return list(self.mixed_sizes)

    @torch.inference_mode()
    def execute(self, step: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """As the torch executor's, but nothing waits for the GPU: the logits stay on it (the
        sampler copies back token ids only), and ``input_ids`` on the GPU (the first of the
        step's) are copied in stream order, behind the kernels of the step that produces them."""
        num_tokens, num_seqs = step.num_tokens, step.num_seqs
        size = next((b for b in self._graph_batches if b >= num_seqs), None)
        if (
            num_tokens != num_seqs
            and size is not None
            and size <= MULTI_TOKEN_MAX_SEQS
            and input_ids is None
        ):
            logits = self._replay_multi_token(step, size)
            if logits is not None:
                return logits
        if num_tokens != num_seqs or size is None:  # prefill or mixed
            if self.mixed_graphs:
                logits = self._replay_mixed(step, input_ids)
                if logits is not None:
                    return logits
            feeds = step.to(self.device, non_blocking=True).as_dict()
            if input_ids is not None:
                feeds["input_ids"] = with_device_ids(feeds["input_ids"], input_ids)
            return self.forward(feeds)
        graph, inputs, logits = self.graphs[size]
        inputs.load(step)
        if input_ids is not None:
            inputs.tensors["input_ids"][: len(input_ids)].copy_(input_ids)
        graph.replay()
        return logits[:num_seqs]

    def _replay_multi_token(self, step: StepInputs, batch: int) -> torch.Tensor | None:
        """A step whose sequences each run at most a bucket's tokens, replayed from the graph of
        (``batch``, bucket), captured now if it is the first of its shape; None when no bucket
        holds it (then the step runs eagerly)."""
        most = int((step.query_start_loc[1:] - step.query_start_loc[:-1]).max())
        tokens = next((q for q in MULTI_TOKEN_BUCKETS if q >= most), None)
        if tokens is None:
            return None
        key = (batch, tokens)
        if key not in self.multi_graphs:
            self.multi_graphs[key] = self._capture_multi_token(batch, tokens)
        graph, inputs, logits = self.multi_graphs[key]
        rows = inputs.load(step)
        graph.replay()
        return logits.index_select(0, rows)

    @torch.inference_mode()
    def _capture_multi_token(self, batch: int, tokens: int) -> tuple:
        inputs = MultiTokenInputs(batch, tokens, self.max_blocks_per_seq, self.device)
        torch.cuda.synchronize(self.device)
        # Their own pool: the logits a verifying step returns are read after the next decode
        # graph is queued (never the other way round: a step's tokens are read before the
        # next multi-token step is built).
        graph, logits = self._capture(inputs.tensors, self._multi_pool)
        self._multi_pool = graph.pool()
        torch.cuda.synchronize(self.device)
        log.info("captured a graph for steps of %d sequences x %d tokens", batch, tokens)
        return graph, inputs, logits


class StepBuffers:
    """A captured graph's step inputs packed into two device buffers (int64 and int32) with host
    twins, pinned on a GPU: loading a step costs two asynchronous host-to-device copies (not one
    copy per tensor plus kernels that fill the padding). Subclasses fill the host twins through
    numpy views (torch ops would each dispatch, and this is on a step's critical path) between
    `_host` and `_send`."""

    def __init__(self, host64: torch.Tensor, host32: torch.Tensor, device: torch.device):
        pinned = device.type == "cuda"
        self.host64 = host64.pin_memory() if pinned else host64
        self.host32 = host32.pin_memory() if pinned else host32
        self.dev64, self.dev32 = self.host64.to(device), self.host32.to(device)
        self.host64_np, self.host32_np = self.host64.numpy(), self.host32.numpy()
        self.copied = torch.cuda.Event() if pinned else None

    def _host(self) -> tuple[np.ndarray, np.ndarray]:
        """The host twins, once the previous step's copies have read them."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host64_np, self.host32_np

    def _send(self, width32: int | None = None) -> None:
        """Queue the copies to the device (of the int32 buffer, its first ``width32``)."""
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32[:width32].copy_(self.host32[:width32], non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class StaticStepInputs(StepBuffers):
    """The static inputs of a captured step of ``batch`` sequences x ``tokens`` tokens each.
    Padding writes no KV (slot -1) and sees ``tokens`` positions of its own."""

    def __init__(self, batch: int, tokens: int, max_blocks: int, device: torch.device):
        self.batch, self.tokens, self.max_blocks = batch, tokens, max_blocks
        width = batch * tokens
        host64 = torch.zeros(3, width, dtype=torch.int64)  # ids, positions, slots
        host32 = torch.zeros(batch * (1 + max_blocks), dtype=torch.int32)  # lengths, tables
        host64[2] = -1
        host32[:batch] = tokens
        super().__init__(host64, host32, device)
        self.tensors = {
            "input_ids": self.dev64[0],
            "positions": self.dev64[1],
            "slot_mapping": self.dev64[2],
            "block_tables": self.dev32[batch:].view(batch, max_blocks),
            "context_lens": self.dev32[:batch],
            "query_start_loc": torch.arange(0, width + 1, tokens, dtype=torch.int32, device=device),
            "logits_indices": torch.arange(width, dtype=torch.int64, device=device),
        }


class MultiTokenInputs(StaticStepInputs):
    """A step's sequences laid out ``tokens`` apart, each padded after its own tokens: the
    padding sits after the real tokens, so their causal view is unchanged (context lengths grow
    by the padding). ``load`` returns the rows of the logits the step asked for."""

    def __init__(self, batch: int, tokens: int, max_blocks: int, device: torch.device):
        super().__init__(batch, tokens, max_blocks, device)
        self.host_rows = torch.zeros(batch * tokens, dtype=torch.int64)
        if device.type == "cuda":
            self.host_rows = self.host_rows.pin_memory()
        self.dev_rows = self.host_rows.to(device)

    def load(self, step: StepInputs) -> torch.Tensor:
        q = self.tokens
        starts = step.query_start_loc.numpy().astype(np.int64)
        counts = np.diff(starts)
        n, width = step.block_tables.shape
        seq_of = np.repeat(np.arange(n), counts)
        # Where each of the step's tokens goes: its sequence's slot of q, at its own offset.
        at = seq_of * q + (np.arange(step.num_tokens) - starts[seq_of])
        h64, h32 = self._host()
        last_position = step.positions.numpy()[starts[1:] - 1]
        h64[0], h64[2] = 0, -1
        h64[1] = np.repeat(np.append(last_position, np.zeros(self.batch - n, np.int64)), q)
        h64[0, at], h64[1, at] = step.input_ids.numpy(), step.positions.numpy()
        h64[2, at] = step.slot_mapping.numpy()
        h32[:n] = step.context_lens.numpy() - counts + q
        h32[n : self.batch] = q
        h32[self.batch :].reshape(self.batch, self.max_blocks)[:n, :width] = (
            step.block_tables.numpy()
        )
        rows = at[step.logits_indices.numpy()]
        self.host_rows.numpy()[: len(rows)] = rows
        self.dev_rows.copy_(self.host_rows, non_blocking=True)
        self._send()
        return self.dev_rows[: len(rows)]


class DecodeInputs(StaticStepInputs):
    """One captured decode graph's inputs: ``batch`` rows of one token. Rows past the step's
    sequences are padding; their logits are never read."""

    def __init__(self, batch: int, max_blocks: int, device: torch.device):
        super().__init__(batch, 1, max_blocks, device)

    def load(self, step: StepInputs) -> None:
        n, width = step.block_tables.shape
        h64, h32 = self._host()
        h64[0, :n], h64[1, :n] = step.input_ids.numpy(), step.positions.numpy()
        h64[2, :n] = step.slot_mapping.numpy()
        h64[:2, n:], h64[2, n:] = 0, -1
        h32[:n], h32[n : self.batch] = step.context_lens.numpy(), 1
        h32[self.batch :].reshape(self.batch, self.max_blocks)[:n, :width] = (
            step.block_tables.numpy()
        )
        self._send()


class MixedStepInputs(StepBuffers):
    """The static inputs of a captured prefill / mixed step of ``tokens`` tokens over ``seqs``
    sequences, with ``seqs`` logits rows. A step of ``n`` sequences and ``t`` tokens fills the
    first ``n`` sequences and ``t`` tokens; sequence ``n`` is padding that takes the remaining
    tokens (slot -1: it writes no KV; it attends to its own positions through block 0, whatever
    that holds: its rows are never read), and the sequences after it have no tokens (their
    attention tiles return at once). ``tokens`` exceeds ``seqs``, so the attention launch is a
    prefill one (`plan`), as the steps' own launches are."""

    def __init__(
        self, tokens: int, seqs: int, max_blocks: int, block_size: int, device: torch.device
    ):
        if tokens <= seqs:
            raise ValueError(f"a mixed-step graph needs more tokens ({tokens}) than seqs ({seqs})")
        if tokens > max_blocks * block_size:  # the padding sequence's block table holds them
            raise ValueError(f"{tokens} tokens exceed a block table ({max_blocks} blocks)")
        self.num_tokens, self.num_seqs = tokens, seqs
        self.max_blocks, self.block_size = max_blocks, block_size
        # int64: ids, positions, slots (tokens each), logits rows (seqs); int32: context lengths
        # (seqs), query starts (seqs + 1), block tables (seqs x max_blocks).
        super().__init__(
            torch.zeros(3 * tokens + seqs, dtype=torch.int64),
            torch.zeros(2 * seqs + 1 + seqs * max_blocks, dtype=torch.int32),
            device,
        )
        t, s = tokens, seqs
        self.tensors = {
            "input_ids": self.dev64[:t],
            "positions": self.dev64[t : 2 * t],
            "slot_mapping": self.dev64[2 * t : 3 * t],
            "logits_indices": self.dev64[3 * t :],
            "context_lens": self.dev32[:s],
            "query_start_loc": self.dev32[s : 2 * s + 1],
            "block_tables": self.dev32[2 * s + 1 :].view(s, max_blocks),
        }
        self.load(None)  # a valid empty step for the capture: all padding

    def fits(self, step: StepInputs) -> bool:
        return (
            step.num_tokens <= self.num_tokens
            and step.num_seqs < self.num_seqs
            and step.logits_indices.shape[0] <= self.num_seqs
            and step.block_tables.shape[1] <= self.max_blocks
        )

    def load(self, step: StepInputs | None) -> int:
        """Copy ``step`` in (None: no sequence, all padding); returns its logits rows."""
        t, s = self.num_tokens, self.num_seqs
        h64, h32 = self._host()
        ids, pos, slots, rows = h64[:t], h64[t : 2 * t], h64[2 * t : 3 * t], h64[3 * t :]
        lens, starts = h32[:s], h32[s : 2 * s + 1]
        tables = h32[2 * s + 1 :].reshape(s, self.max_blocks)
        n = step.num_seqs if step is not None else 0
        used = step.num_tokens if step is not None else 0
        logits = step.logits_indices.shape[0] if step is not None else 0
        if step is not None:
            ids[:used], pos[:used] = step.input_ids.numpy(), step.positions.numpy()
            slots[:used] = step.slot_mapping.numpy()
            rows[:logits] = step.logits_indices.numpy()
            lens[:n], starts[: n + 1] = step.context_lens.numpy(), step.query_start_loc.numpy()
            tables[:n, : step.block_tables.shape[1]] = step.block_tables.numpy()
        pad = t - used
        ids[used:], pos[used:], slots[used:], rows[logits:] = 0, np.arange(pad), -1, 0
        lens[n], lens[n + 1 :] = pad, 0
        starts[n + 1 :] = t
        # The padding sequence reads its blocks (block 0); the rows after it are never read
        # (no tokens), so only the tables up to its row are copied.
        tables[n, : -(-pad // self.block_size)] = 0
        self._send(width32=2 * s + 1 + (n + 1) * self.max_blocks)
        return logits
