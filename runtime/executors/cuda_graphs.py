"""The CUDA executor's captured step graphs, in three families, each with its own static inputs
(`step_buffers.py`), its captured graphs by size and one memory pool that its graphs share (one
step runs at a time, and its logits are sampled before the next is queued; captured largest
first, the smaller graphs reuse the largest's memory).

- `DecodeGraphs`: a graph per batch size; a step of ``n`` sequences replays the smallest
  captured size ``>= n``; the extra rows are padding (slot -1, so nothing is written; one
  visible cached position, so nothing divides by zero) and their logits are dropped.
- `VerifyGraphs`: steps of a few tokens a sequence (speculative verification): a graph per
  (batch, tokens) bucket, captured on first use, each sequence padded to its bucket's tokens.
- `MixedGraphs`: prefill and mixed prefill + decode steps: a graph per token bucket over every
  sequence a step may run and one more: the step's tokens are followed by one padding sequence
  that takes the bucket's remaining tokens, and the sequences after it have none. The attention
  kernels' launch depends on shapes only, so one graph serves every step of its bucket. The
  family's graphs all write their logits into one ``[seqs, vocab]`` buffer, not one a bucket.

Which family and size a step replays is `graph_dispatch.py`'s; when each graph is captured,
`capture_plan.py`'s."""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from trtc.contract import StepInputs
from trtc.runtime.executors.step_buffers import DecodeInputs, MixedStepInputs, MultiTokenInputs

log = logging.getLogger("trtc.executor")

Forward = Callable[[dict[str, torch.Tensor]], torch.Tensor]
StaticInputs = DecodeInputs | MultiTokenInputs | MixedStepInputs


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a CPU has none)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CapturedGraph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: StaticInputs  # what the graph reads
    logits: torch.Tensor  # what the graph writes its logits to


class GraphFamily:
    """Graphs of one step layout, by size: ``capture_sizes`` are captured at start (or after,
    `capture_plan.py`), `pick` chooses among those captured, `replay` runs a step in one.
    Subclasses build the layout's static inputs (`make_inputs`)."""

    #: What the sizes are (the capture log's words).
    label = "sizes"

    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        max_blocks: int,
        capture_sizes: list[Hashable] | None = None,
    ):
        self.forward, self.device, self.max_blocks = forward, device, max_blocks
        self.capture_sizes = list(capture_sizes or [])
        self.graphs: dict[Hashable, CapturedGraph] = {}
        self.sizes: list = []  # the sizes of `graphs`, ascending: what `pick` reads
        self.pool = None  # the memory pool of the family's graphs (the first capture's)
        self.out: torch.Tensor | None = None  # the logits buffer the graphs share, if they do

    def make_inputs(self, size: Hashable) -> StaticInputs:
        """The static inputs of the graph of ``size``."""
        raise NotImplementedError

    def pick(self, n: int) -> Hashable | None:
        """The smallest captured size ``>= n``; None when none is."""
        i = bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def add(self, size: Hashable, captured: CapturedGraph) -> None:
        """Keep the graph of ``size`` for `pick` and `replay`."""
        self.graphs[size] = captured
        self.sizes = sorted(self.graphs)

    def clear(self) -> None:
        """Drop the graphs and their pool (the shared logits buffer stays)."""
        self.graphs.clear()
        self.sizes, self.pool = [], None

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Pick none of the graphs meanwhile: their steps run as if none were captured."""
        self.sizes = []
        try:
            yield
        finally:
            self.sizes = sorted(self.graphs)

    def warm(self, size: Hashable) -> StaticInputs:
        """The static inputs of ``size``'s graph, with the step run once on them: the graph's
        capture (`record`) comes next."""
        return self.run_once(self.make_inputs(size))

    def run_once(self, inputs: StaticInputs) -> StaticInputs:
        """Run the step on ``inputs`` once on a side stream before its capture: the kernels of
        its shapes are compiled or loaded (a Triton kernel specializes on some of them) outside
        it. Returns ``inputs``."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.forward(inputs.tensors)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return inputs

    def record(self, size: Hashable, inputs: StaticInputs) -> None:
        """Capture the warmed graph of ``size`` into the family's pool (with `out`, the graph
        copies its logits into it)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.forward(inputs.tensors)
            if self.out is not None:
                logits = self.out.copy_(logits)
        self.pool = graph.pool()
        self.add(size, CapturedGraph(graph, inputs, logits))
        synchronize(self.device)

    def capture(self, size: Hashable) -> None:
        """`warm`, then `record`, at once."""
        self.record(size, self.warm(size))

    def replay(
        self, size: Hashable, step: StepInputs, input_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """``step`` run by the graph of ``size``: its inputs loaded, ``input_ids`` (on the
        device) copied over its first ids in stream order; the logits rows it asked for."""
        graph, inputs, logits = self.graphs[size]
        rows = inputs.load(step)
        if input_ids is not None:
            inputs.tensors["input_ids"][: len(input_ids)].copy_(input_ids)
        graph.replay()
        return logits[:rows]


class DecodeGraphs(GraphFamily):
    """Decode steps: a graph per batch size (`DecodeInputs`)."""

    label = "decode batches"

    def make_inputs(self, batch: int) -> DecodeInputs:
        return DecodeInputs(batch, self.max_blocks, self.device)


class VerifyGraphs(GraphFamily):
    """Steps of a few tokens a sequence: a graph per (batch, tokens), captured the first time a
    step of its shape comes (`MultiTokenInputs`), into its own pool: the logits a verifying
    step returns are read after the next decode graph is queued (never the other way round: a
    step's tokens are read before the next multi-token step is built)."""

    label = "multi-token (batch, tokens)"

    def make_inputs(self, size: tuple[int, int]) -> MultiTokenInputs:
        batch, tokens = size
        return MultiTokenInputs(batch, tokens, self.max_blocks, self.device)

    def replay(
        self, size: tuple[int, int], step: StepInputs, input_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """As `GraphFamily.replay`, capturing the graph first if it is the first of its shape;
        ``input_ids`` is None (the dispatcher sends no step with device ids here)."""
        if size not in self.graphs:
            self.capture_on_first_use(size)
        graph, inputs, logits = self.graphs[size]
        rows = inputs.load(step)
        graph.replay()
        return logits.index_select(0, rows)

    @torch.inference_mode()
    def capture_on_first_use(self, size: tuple[int, int]) -> None:
        inputs = self.make_inputs(size)
        synchronize(self.device)
        self.record(size, self.run_once(inputs))
        log.info("captured a graph for steps of %d sequences x %d tokens", *size)


class MixedGraphs(GraphFamily):
    """Prefill and mixed steps: a graph per token bucket over ``seqs`` sequences
    (`MixedStepInputs`), their logits in one shared buffer (`out`, made with the first
    inputs)."""

    label = "prefill / mixed-step tokens"

    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        max_blocks: int,
        capture_sizes: list[int],
        seqs: int,
        block_size: int,
        vocab_size: int,
    ):
        super().__init__(forward, device, max_blocks, capture_sizes)
        self.seqs, self.block_size, self.vocab_size = seqs, block_size, vocab_size

    def make_inputs(self, tokens: int) -> MixedStepInputs:
        if self.out is None:
            self.out = torch.empty(
                self.seqs, self.vocab_size, dtype=torch.float32, device=self.device
            )
        return MixedStepInputs(tokens, self.seqs, self.max_blocks, self.block_size, self.device)
