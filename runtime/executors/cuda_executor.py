"""The CUDA executor: the torch executor on a GPU, with the KV pool preallocated from a memory
fraction (`kv_pool_sizing.py`) and steps replayed from CUDA graphs (a decode step run eagerly is
mostly host overhead on a small model: a few hundred kernel launches from Python).

A step replays a graph of one of three families (`cuda_graphs.py`): decode steps a graph per
batch size, steps of a few tokens a sequence (speculative verification) a graph per (batch,
tokens) bucket captured on first use, prefill and mixed prefill + decode steps a graph per token
bucket (`MIXED_TOKEN_BUCKETS`). Run eagerly, a prefill or mixed step waits for its kernels to be
queued from Python, several times as long as a decode step of as many sequences
(docs/benchmarks-journal.md, 2026-12-06); ``TRTC_MIXED_GRAPHS=0`` (or ``mixed_graphs=False``)
runs them eagerly. Which graph a step replays, or whether it runs eagerly (longer steps, and
steps asking for more logits rows than the graphs' sequences), is the dispatcher's
(`graph_dispatch.py`).

The decode and prefill / mixed-step graphs are captured at start; a server's
(``defer_graphs``, `EngineConfig.defer_graphs`) captures only the one-sequence decode graph and
the smallest prefill / mixed-step one before it is ready and the others a piece at a time after
(`capture_deferred`, `capture_plan.py`), so a replica is ready sooner; a step whose graph is not
there yet replays a larger one or runs eagerly (`trtc tune` ships the kernels of the eager
launches too)."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from trtc import envs
from trtc.artifact import Artifact
from trtc.contract import SequenceWork, StepInputs, make_step
from trtc.runtime.engine.startup import StartupPhases
from trtc.runtime.executors.capture_plan import CapturePlan
from trtc.runtime.executors.cuda_graphs import DecodeGraphs, MixedGraphs, VerifyGraphs
from trtc.runtime.executors.fusions import RUNTIME_OPS, fuse
from trtc.runtime.executors.graph import GraphNode
from trtc.runtime.executors.graph_dispatch import GraphDispatcher
from trtc.runtime.executors.kv_pool_sizing import (
    decode_graph_sizes,
    mixed_graph_seqs,
    mixed_token_buckets,
    pool_blocks,
)
from trtc.runtime.executors.torch_executor import TorchExecutor, with_device_ids
from trtc.runtime.executors.torch_ops import ONNX_OPS
from trtc.runtime.executors.tuning import apply as apply_tuning
from trtc.runtime.executors.tuning import load_tuning

log = logging.getLogger("trtc.executor")

# The longest step the start-up warm-up runs (see `CudaExecutor.warm_up`): the activations of a
# step this long stay in the caching allocator, within the 1 GiB the KV pool is sized around.
WARM_UP_TOKENS = 2048


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
        self._start_device(artifact, device, use_tuning)
        self.fuse_kernels = fuse_kernels
        # The INT4 Linears held in the fragment layout instead of the plugin's
        # (fusions/int4_fragment.py): faster decode steps, prefill through a dequantized
        # transient weight; TRTC_INT4_FRAGMENTS=0 (or int4_fragments=False) keeps them as stored.
        if int4_fragments is None:
            int4_fragments = envs.TRTC_INT4_FRAGMENTS
        self.int4_fragments = int4_fragments and fuse_kernels
        self.fusions: dict[str, int] = {}
        if mixed_graphs is None:
            mixed_graphs = envs.TRTC_MIXED_GRAPHS
        mixed_graphs = mixed_graphs and use_cuda_graphs
        if num_blocks is None:
            num_blocks = pool_blocks(
                artifact.manifest, device, memory_fraction, self.int4_fragments, mixed_graphs
            )
        super().__init__(artifact, num_blocks, device, rank, startup=self.startup)
        self.max_blocks_per_seq = -(-self.manifest.limits.max_seq_len // self.block_size)
        self._make_graph_families(max_graph_batch, mixed_graphs)
        with self.startup.phase(
            "kernels",
            "loaded from the artifact's tuning" if self.tuning else "compiled (not tuned here)",
        ):
            self.warm_up()
        if use_cuda_graphs:
            self._capture_at_start(defer_graphs)

    def _start_device(self, artifact: Artifact, device: str, use_tuning: bool) -> None:
        """The CUDA context, then (before anything launches a Triton kernel) a tuned
        artifact's kernels and choices."""
        with self.startup.phase("cuda context"):
            torch.cuda.init()
            torch.empty(1, device=device)  # the context and the caching allocator
        with self.startup.phase("tuning"):
            use_tuning = use_tuning and envs.TRTC_TUNING
            self.tuning = load_tuning(artifact, torch.device(device)) if use_tuning else None
            if self.tuning is not None:
                apply_tuning(self.tuning)

    def _make_graph_families(self, max_graph_batch: int | None, mixed_graphs: bool) -> None:
        """The graph families (none captured yet), the dispatcher that picks among them and
        the plan of their captures: decode graphs first, then prefill / mixed-step ones."""
        limits = self.manifest.limits
        batches = decode_graph_sizes(limits, max_graph_batch)
        seqs = mixed_graph_seqs(batches[-1])
        buckets = mixed_token_buckets(limits, seqs) if mixed_graphs else []
        blocks = self.max_blocks_per_seq
        self.decode = DecodeGraphs(self.forward, self.device, blocks, batches)
        self.verify = VerifyGraphs(self.forward, self.device, blocks)
        vocab = self.manifest.model.vocab_size
        self.mixed = MixedGraphs(
            self.forward, self.device, blocks, buckets, seqs, self.block_size, vocab
        )
        self.dispatcher = GraphDispatcher(self.decode, self.verify, self.mixed)
        self.capture_plan = CapturePlan((self.decode, self.mixed), self.device)

    def _capture_at_start(self, defer_graphs: bool) -> None:
        """Capture every decode and prefill / mixed-step graph, or with ``defer_graphs`` only
        the one-sequence decode graph and the smallest prefill / mixed-step one, which also
        runs decode steps of any batch (their tokens fit): until the rest are captured
        (`capture_deferred`), short prompts and every decode step replay a graph."""
        with self.startup.phase("graphs") as phases:
            reserved = torch.cuda.memory_reserved(self.device)
            if defer_graphs:
                self.capture_plan.replan((self.decode, self.mixed))
                for family in (self.decode, self.mixed):
                    if family.capture_sizes:
                        self.capture_plan.capture_now(family, family.capture_sizes[0])
            else:
                self.capture_graphs()
            # (A capture empties the allocator's cache first: what the warm-up left there
            # can outweigh a small graph's pool.)
            held = torch.cuda.memory_reserved(self.device) - reserved
            left = len(self.capture_plan.pending)
            later = f", {left} after ready" if left else ""
            size = f", {held / 2**20:.0f} MiB" if held > 0 else ""
            phases.note(
                "graphs",
                f"{len(self.decode.capture_sizes)} decode batch sizes, "
                f"{len(self.mixed.capture_sizes)} prefill / mixed token buckets{later}{size}",
            )

    @property
    def graph_sizes(self) -> list[int]:
        """The batch sizes of the decode graphs (those captured at start, or after it)."""
        return self.decode.capture_sizes

    @property
    def step_token_buckets(self) -> list[int]:
        """The token counts a prefill or mixed step is padded up to (the mixed-step graphs';
        longer steps run eagerly, as they are). The scheduler fits steps to them."""
        return list(self.mixed.capture_sizes)

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
        graphs it times, then everything with the winners). Without ``mixed``, the prefill /
        mixed-step graphs still to capture stay in the plan, after the decode ones."""
        self.capture_plan.replan((self.decode, self.mixed) if mixed else (self.decode,))
        while self.capture_plan.capture_next_piece():
            pass

    @torch.inference_mode()
    def capture_deferred(self) -> bool:
        """Do the next piece of capturing the graphs still to capture: a graph's warm-up run,
        then its capture (each a few milliseconds of host time, so that a step that comes
        meanwhile waits for one piece at most); True while some are left. Until a step's graph
        is there, the step runs in the smallest captured graph that holds it, or eagerly."""
        return self.capture_plan.capture_next_piece()

    @contextmanager
    def graphs_set_aside(self):
        """Run every step eagerly meanwhile, as a server's steps run before their graphs are
        captured (``defer_graphs``) and as steps beyond the graphs always do: `trtc tune` runs
        its serving shapes so too, so that the kernels of those launches ship as well. (The
        multi-token graphs go with the decode ones: a step uses them at a decode batch size.)"""
        with self.decode.set_aside(), self.mixed.set_aside():
            yield

    @torch.inference_mode()
    def execute(self, step: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """As the torch executor's, but nothing waits for the GPU: the logits stay on it (the
        sampler copies back token ids only), and ``input_ids`` on the GPU (the first of the
        step's) are copied in stream order, behind the kernels of the step that produces them.
        The step replays the graph the dispatcher picks, or runs eagerly."""
        graph = self.dispatcher.dispatch(step, input_ids is not None)
        if graph is not None:
            family, size = graph
            return family.replay(size, step, input_ids)
        feeds = step.to(self.device, non_blocking=True).as_dict()
        if input_ids is not None:
            feeds["input_ids"] = with_device_ids(feeds["input_ids"], input_ids)
        return self.forward(feeds)
