"""The CUDA executor's graph families, dispatch and capture plan, run on the CPU: each family's
"captured graph" is a stand-in that runs the compiled graph on the family's static inputs, as
a replay would, so the padded layouts, the logits rows a replay returns, the copy of device
input ids and the order of (deferred) captures are checked without a GPU."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from trtc.artifact import Artifact
from trtc.contract import SequenceWork, make_step
from trtc.runtime.executors.capture_plan import CapturePlan
from trtc.runtime.executors.cuda_executor import CudaExecutor
from trtc.runtime.executors.cuda_graphs import (
    CapturedGraph,
    DecodeGraphs,
    MixedGraphs,
    VerifyGraphs,
)
from trtc.runtime.executors.graph_dispatch import GraphDispatcher
from trtc.runtime.executors.torch_executor import TorchExecutor, with_device_ids

CPU = torch.device("cpu")
PROMPTS = [list(range(5, 45)), list(range(100, 117)), list(range(3, 9))]
TABLES = [[0, 1, 2, 3], [10, 11, 12], [20, 21]]


class StandInGraph:
    """A captured graph on the CPU: a replay runs the step on the static inputs and writes
    the logits where the graph's are."""

    def __init__(self, forward, tensors: dict, logits: torch.Tensor):
        self.forward, self.tensors, self.logits = forward, tensors, logits

    def replay(self) -> None:
        self.logits.copy_(self.forward(dict(self.tensors)))


class OnCpu:
    """A family whose captures are `StandInGraph`s; it records what it warmed and captured."""

    def __init__(self, *args, events: list | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = events if events is not None else []

    def run_once(self, inputs):
        self.events.append(("warm", self.label))
        self.forward(inputs.tensors)
        return inputs

    def record(self, size, inputs) -> None:
        self.events.append(("capture", self.label, size))
        logits = self.forward(inputs.tensors)
        if self.out is not None:
            logits = self.out.copy_(logits)
        graph = StandInGraph(self.forward, inputs.tensors, logits)
        self.add(size, CapturedGraph(graph, inputs, logits))


class CpuDecodeGraphs(OnCpu, DecodeGraphs):
    pass


class CpuVerifyGraphs(OnCpu, VerifyGraphs):
    pass


class CpuMixedGraphs(OnCpu, MixedGraphs):
    pass


def graphed_executor(art: Artifact, events: list | None = None):
    """A torch executor with the CUDA executor's graph families (on the CPU), dispatcher and
    capture plan, and its `execute`: decode batches 1, 2, 4 and 8, mixed-step buckets 128
    and 192 over 9 sequences. Nothing captured yet."""
    ex = TorchExecutor(art, num_blocks=64)
    vocab = art.manifest.model.vocab_size
    ex.decode = CpuDecodeGraphs(ex.forward, CPU, 16, [1, 2, 4, 8], events=events)
    ex.verify = CpuVerifyGraphs(ex.forward, CPU, 16, events=events)
    ex.mixed = CpuMixedGraphs(ex.forward, CPU, 16, [128, 192], 9, 16, vocab, events=events)
    ex.dispatcher = GraphDispatcher(ex.decode, ex.verify, ex.mixed)
    ex.capture_plan = CapturePlan((ex.decode, ex.mixed), CPU)
    ex.graphed = SimpleNamespace(dispatcher=ex.dispatcher, device=CPU, forward=ex.forward)
    return ex


def execute(ex, step, input_ids=None) -> torch.Tensor:
    """`CudaExecutor.execute` on ``ex``'s families."""
    return CudaExecutor.execute(ex.graphed, step, input_ids)


def family_name(ex, choice) -> str | None:
    """Which of ``ex``'s families a dispatch ``choice`` replays (None: eager)."""
    if choice is None:
        return None
    return next(n for n in ("decode", "verify", "mixed") if getattr(ex, n) is choice[0])


def steps():
    """(step, device input ids or None, the family it replays or None) of a prefill, decodes
    with host and device ids, a verifying step, a mixed step with device ids and a prefill
    longer than every bucket."""
    done = [len(p) for p in PROMPTS]
    yield make_step([SequenceWork(p, 0, t) for p, t in zip(PROMPTS, TABLES)], 16), None, "mixed"
    yield make_step([SequenceWork([7], d, t) for d, t in zip(done, TABLES)], 16), None, "decode"
    ids = torch.tensor([21, 22, 23])
    yield make_step([SequenceWork([0], d + 1, t) for d, t in zip(done, TABLES)], 16), ids, "decode"
    news = [[7, 8, 9, 10, 11], [12], [13, 14, 15]]
    work = [SequenceWork(n, d + 2, t, len(n)) for n, d, t in zip(news, done, TABLES)]
    yield make_step(work, 16), None, "verify"
    done = [d + 2 + len(n) for d, n in zip(done, news)]
    work = [SequenceWork([0], d, t) for d, t in zip(done[:2], TABLES)]
    work.append(SequenceWork(list(range(60, 150)), 0, [30, 31, 32, 33, 34, 35]))  # a chunk
    yield make_step(work, 16), torch.tensor([31, 32]), "mixed"
    yield make_step([SequenceWork(list(range(1, 201)), 0, list(range(40, 53)))], 16), None, None


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_steps_replayed_from_each_family_give_the_eager_logits_and_kv(tiny_artifacts, name):
    art = Artifact.open(tiny_artifacts[name])
    plain = TorchExecutor(art, num_blocks=64)
    graphed = graphed_executor(art)
    graphed.capture_plan.replan((graphed.decode, graphed.mixed))
    while graphed.capture_plan.capture_next_piece():
        pass
    for step, ids, family in steps():
        feeds = step.as_dict()
        if ids is not None:
            feeds["input_ids"] = with_device_ids(feeds["input_ids"], ids)
        want = plain.forward(feeds)
        assert family_name(graphed, graphed.dispatcher.dispatch(step, ids is not None)) == family
        got = execute(graphed, step, ids)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(graphed.kv_pool, plain.kv_pool, atol=1e-5, rtol=1e-5)
    assert set(graphed.verify.graphs) == {(4, 5)}  # captured on first use


def test_captures_go_decode_first_largest_first_a_piece_at_a_time(tiny_artifacts, caplog):
    events = []
    ex = graphed_executor(Artifact.open(tiny_artifacts["tiny-llama"]), events)
    plan = ex.capture_plan
    # A server's start (defer_graphs): the smallest of each, the rest after ready.
    plan.replan((ex.decode, ex.mixed))
    plan.capture_now(ex.decode, 1)
    plan.capture_now(ex.mixed, 128)
    assert [(f.label, s) for f, s in plan.pending] == [
        ("decode batches", 8),
        ("decode batches", 4),
        ("decode batches", 2),
        ("prefill / mixed-step tokens", 192),
    ]
    assert (ex.decode.sizes, ex.mixed.sizes) == ([1], [128])
    events.clear()
    for _ in range(7):  # decode 8, 4, 2; mixed 192 warmed
        assert plan.capture_next_piece()
    assert events[-2:] == [
        ("capture", "decode batches", 2),
        ("warm", "prefill / mixed-step tokens"),
    ]
    assert ex.decode.sizes == [1, 2, 4, 8] and ex.mixed.sizes == [128]
    # A recapture of the decode graphs (`capture_graphs(mixed=False)`) keeps the mixed-step
    # one still to capture, warmed again after them.
    plan.replan((ex.decode,))
    assert ex.decode.sizes == [] and ex.mixed.sizes == [128]
    assert [s for _, s in plan.pending] == [8, 4, 2, 1, 192]
    events.clear()
    with caplog.at_level(logging.INFO, logger="trtc.executor"):
        while plan.capture_next_piece():
            pass
    assert [e[-1] for e in events if e[0] == "capture"] == [8, 4, 2, 1, 192]
    assert len(events) == 10  # a warm-up and a capture each
    assert "graphs: decode batches [1, 2, 4, 8], prefill / mixed-step tokens [128, 192]" in (
        caplog.text
    )
    assert plan.capture_next_piece() is False


def test_graphs_captured_later_are_used_as_they_come(tiny_artifacts):
    """Until a step's graph is captured it replays the smallest captured graph that holds it
    (a decode step of several sequences: the smallest mixed-step graph), or runs eagerly."""
    ex = graphed_executor(Artifact.open(tiny_artifacts["tiny-llama"]))
    decode = make_step([SequenceWork([9], 10, [i]) for i in range(3)], 16)
    short = make_step([SequenceWork(p, 0, t) for p, t in zip(PROMPTS, TABLES)], 16)  # 63 tokens
    long = make_step([SequenceWork(list(range(1, 150)), 0, list(range(30, 40)))], 16)
    seen = []
    ex.capture_plan.replan((ex.decode, ex.mixed))
    # Nothing yet; decode 8; decode 4, 2, 1; mixed 192; mixed 128.
    for pieces in (0, 2, 6, 2, 2):
        for _ in range(pieces):
            ex.capture_plan.capture_next_piece()
        choices = [ex.dispatcher.dispatch(s, False) for s in (decode, short, long)]
        seen.append([c and (family_name(ex, c), c[1]) for c in choices])
    assert seen == [
        [None, None, None],
        [("decode", 8), None, None],
        [("decode", 4), None, None],
        [("decode", 4), ("mixed", 192), ("mixed", 192)],
        [("decode", 4), ("mixed", 128), ("mixed", 192)],
    ]
