"""The CUDA executor: the torch executor on a GPU, with the KV pool preallocated from a memory
fraction and decode steps captured as CUDA graphs for a set of batch sizes (a decode step of a
small model is mostly host overhead otherwise). Steps of a few tokens a sequence (speculative
verification) replay graphs too, captured on first use; longer prefill and mixed steps run
eagerly.

A decode step of ``n`` sequences replays the graph of the smallest captured size ``>= n``; the
extra rows are padding (slot -1, so nothing is written; one visible cached position, so nothing
divides by zero) and their logits are dropped. A multi-token step is laid out the same way, each
sequence padded to its bucket's tokens (`MultiTokenInputs`)."""

from __future__ import annotations

import logging

import numpy as np
import torch

from trtc import envs
from trtc.artifact import Artifact, Manifest
from trtc.contract import SequenceWork, StepInputs, make_step
from trtc.runtime.core.startup import StartupPhases
from trtc.runtime.executors.fusions import RUNTIME_OPS, fuse
from trtc.runtime.executors.fusions.int4_fragment import int4_fragment_bytes
from trtc.runtime.executors.graph import GraphNode
from trtc.runtime.executors.torch_executor import TorchExecutor
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
        if num_blocks is None:
            num_blocks = self.pool_blocks(manifest, device, memory_fraction, self.int4_fragments)
        super().__init__(artifact, num_blocks, device, rank)
        limits = manifest.limits
        self.max_blocks_per_seq = -(-limits.max_seq_len // self.block_size)
        top = min(max_graph_batch or limits.max_num_seqs, limits.max_num_seqs)
        self.graph_sizes = [b for b in GRAPH_BATCH_SIZES if b <= top] or [1]
        if self.graph_sizes[-1] < top:
            self.graph_sizes.append(top)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, DecodeInputs, torch.Tensor]] = {}
        # Steps of up to MULTI_TOKEN_BUCKETS[-1] tokens a sequence (speculative verification,
        # short chunks), captured the first time a shape is met: (batch, tokens) -> graph.
        self.multi_graphs: dict[tuple[int, int], tuple] = {}
        self._multi_pool = None
        with self.startup.phase(
            "kernels",
            "loaded from the artifact's tuning" if self.tuning else "compiled (not tuned here)",
        ):
            self.warm_up()
        if use_cuda_graphs:
            with self.startup.phase("graphs", f"{len(self.graph_sizes)} decode batch sizes"):
                self.capture_graphs()

    @staticmethod
    def pool_blocks(
        manifest: Manifest,
        device: str | torch.device = "cuda",
        memory_fraction: float = 0.9,
        int4_fragments: bool = True,
    ) -> int:
        """The KV blocks a pool on ``device`` gets by default: what ``memory_fraction`` of
        the GPU holds after the weights (and their fragment-layout copies)."""
        weight_bytes = manifest.graph.weight_bytes["total"]
        if int4_fragments:
            weight_bytes += int4_fragment_bytes(manifest)
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
    def capture_graphs(self) -> None:
        """Capture (again) a decode graph per batch size, with the kernels' launch settings as
        they are now (the profile's A/B of programmatic dependent launch and the GEMV)."""
        self.graphs.clear()
        torch.cuda.synchronize(self.device)
        pool = None
        for batch in sorted(
            self.graph_sizes, reverse=True
        ):  # largest first: smaller ones reuse its memory
            inputs = DecodeInputs(batch, self.max_blocks_per_seq, self.device)
            graph, logits = self._capture(inputs.tensors, pool)
            pool = graph.pool()
            self.graphs[batch] = (graph, inputs, logits)
        torch.cuda.synchronize(self.device)

    def _capture(self, tensors: dict, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The step graph on static ``tensors`` as a CUDA graph (memory from ``pool``), after
        two warm-up runs that compile the kernels and settle the allocator."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(tensors)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.forward(tensors)
        return graph, logits

    @torch.inference_mode()
    def execute(self, step: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """As the torch executor's, but nothing waits for the GPU: the logits stay on it (the
        sampler copies back token ids only), and ``input_ids`` on the GPU are copied in stream
        order, behind the kernels of the step that produces them."""
        num_tokens, num_seqs = step.num_tokens, step.num_seqs
        size = next((b for b in sorted(self.graphs) if b >= num_seqs), None)
        if (
            num_tokens != num_seqs
            and size is not None
            and size <= MULTI_TOKEN_MAX_SEQS
            and input_ids is None
        ):
            logits = self._replay_multi_token(step, size)
            if logits is not None:
                return logits
        if num_tokens != num_seqs or size is None:  # prefill or mixed: eager
            feeds = step.to(self.device, non_blocking=True).as_dict()
            if input_ids is not None:
                feeds["input_ids"] = input_ids
            return self.forward(feeds)
        graph, inputs, logits = self.graphs[size]
        inputs.load(step)
        if input_ids is not None:
            inputs.tensors["input_ids"][:num_seqs].copy_(input_ids)
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


class StaticStepInputs:
    """The static inputs of a captured step of ``batch`` sequences x ``tokens`` tokens each,
    packed into two device buffers with pinned host twins: loading a step costs two
    asynchronous host-to-device copies (not one copy per tensor plus kernels that fill the
    padding). Padding writes no KV (slot -1) and sees ``tokens`` positions of its own."""

    def __init__(self, batch: int, tokens: int, max_blocks: int, device: torch.device):
        self.batch, self.tokens, self.max_blocks = batch, tokens, max_blocks
        width = batch * tokens
        self.host64 = torch.zeros(3, width, dtype=torch.int64).pin_memory()  # ids, pos, slots
        self.host32 = torch.zeros(batch * (1 + max_blocks), dtype=torch.int32).pin_memory()
        self.host64[2] = -1
        self.host32[:batch] = tokens
        self.dev64, self.dev32 = self.host64.to(device), self.host32.to(device)
        # Filled through numpy views of the pinned buffers: torch ops would each dispatch, and
        # this is on a step's critical path.
        self.host64_np, self.host32_np = self.host64.numpy(), self.host32.numpy()
        self.copied = torch.cuda.Event()
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
        self.host_rows = torch.zeros(batch * tokens, dtype=torch.int64).pin_memory()
        self.dev_rows = self.host_rows.to(device)

    def load(self, step: StepInputs) -> torch.Tensor:
        q = self.tokens
        starts = step.query_start_loc.numpy().astype(np.int64)
        counts = np.diff(starts)
        n, width = step.block_tables.shape
        seq_of = np.repeat(np.arange(n), counts)
        # Where each of the step's tokens goes: its sequence's slot of q, at its own offset.
        at = seq_of * q + (np.arange(step.num_tokens) - starts[seq_of])
        self.copied.synchronize()  # the previous step's copies have read the host buffers
        h64, h32 = self.host64_np, self.host32_np
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
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        self.dev_rows.copy_(self.host_rows, non_blocking=True)
        self.copied.record()
        return self.dev_rows[: len(rows)]


class DecodeInputs(StaticStepInputs):
    """One captured decode graph's inputs: ``batch`` rows of one token. Rows past the step's
    sequences are padding; their logits are never read."""

    def __init__(self, batch: int, max_blocks: int, device: torch.device):
        super().__init__(batch, 1, max_blocks, device)

    def load(self, step: StepInputs) -> None:
        n, width = step.block_tables.shape
        self.copied.synchronize()  # the previous step's copies have read the host buffers
        h64, h32 = self.host64_np, self.host32_np
        h64[0, :n], h64[1, :n] = step.input_ids.numpy(), step.positions.numpy()
        h64[2, :n] = step.slot_mapping.numpy()
        h64[:2, n:], h64[2, n:] = 0, -1
        h32[:n], h32[n : self.batch] = step.context_lens.numpy(), 1
        h32[self.batch :].reshape(self.batch, self.max_blocks)[:n, :width] = (
            step.block_tables.numpy()
        )
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        self.copied.record()
