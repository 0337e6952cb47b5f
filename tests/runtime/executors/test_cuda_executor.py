"""GPU execution (marker `gpu`; skipped without CUDA): the CUDA executor (Triton kernels, CUDA
graphs) against the CPU torch executor on the same compiled graph."""

from __future__ import annotations

import pytest
import torch

from trtc.artifact import Artifact
from trtc.contract import SequenceWork, make_step
from trtc.runtime.core.sequence import SamplingParams
from trtc.runtime.engine import LLM
from trtc.runtime.executors.torch_executor import TorchExecutor

pytestmark = pytest.mark.gpu


def test_cuda_executor_matches_cpu(tiny_artifacts):
    from trtc.runtime.executors.cuda_executor import CudaExecutor

    art = tiny_artifacts["tiny-llama"]
    cpu = TorchExecutor(Artifact.open(art), num_blocks=64)
    gpu = CudaExecutor(Artifact.open(art), num_blocks=64)
    assert gpu.decode.graphs, "decode graphs were captured"
    prompts = [list(range(5, 45)), list(range(100, 117)), list(range(3, 9))]
    tables = [[0, 1, 2, 3], [10, 11, 12], [20, 21]]
    steps = [[SequenceWork(p, 0, t) for p, t in zip(prompts, tables)]]
    for i in range(5):  # decode steps: graph replays
        steps.append([SequenceWork([7 + i], len(p) + i, t) for p, t in zip(prompts, tables)])
    for work in steps:
        step = make_step(work, 16)
        a, b = cpu.execute(step), gpu.execute(step).cpu()
        torch.testing.assert_close(b, a, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_multi_token_steps_replay_a_graph_with_the_eager_logits(tiny_artifacts, name):
    """Steps of a few tokens a sequence (verifying drafts) run from a captured graph, each
    sequence padded to its bucket; the logits the step asks for equal the eager run's and the
    KV cache gets the same writes."""
    from trtc.runtime.executors.cuda_executor import CudaExecutor

    art = Artifact.open(tiny_artifacts[name])
    eager = CudaExecutor(art, num_blocks=64, use_cuda_graphs=False)
    graphed = CudaExecutor(art, num_blocks=64)
    prompts = [list(range(5, 45)), list(range(100, 117)), list(range(3, 9))]
    tables = [[0, 1, 2, 3], [10, 11, 12], [20, 21]]
    prefill = make_step([SequenceWork(p, 0, t) for p, t in zip(prompts, tables)], 16)
    for ex in (eager, graphed):
        ex.execute(prefill)
    # 5, 1 and 3 new tokens (drafts), logits of each sequence's last 5, 1 and 3.
    news = [[7, 8, 9, 10, 11], [12], [13, 14, 15]]
    work = [SequenceWork(n, len(p), t, num_logits=len(n)) for n, p, t in zip(news, prompts, tables)]
    step = make_step(work, 16)
    a, b = eager.execute(step), graphed.execute(step)
    assert (4, 5) in graphed.verify.graphs  # 3 sequences: the batch-4 graph, bucket 5
    assert b.shape == (9, a.shape[1])
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(graphed.kv_pool, eager.kv_pool, atol=1e-5, rtol=1e-5)
    done = [len(p) + len(n) for p, n in zip(prompts, news)]
    for i in range(2):  # two tokens a sequence: bucket 2, captured once, then replayed
        follow = make_step(
            [SequenceWork([1, 2], d + 2 * i, t, 2) for d, t in zip(done, tables)], 16
        )
        torch.testing.assert_close(
            graphed.execute(follow), eager.execute(follow), atol=1e-4, rtol=1e-4
        )
    assert set(graphed.verify.graphs) == {(4, 5), (4, 2)}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_mixed_steps_replay_a_token_bucket_graph_with_the_eager_logits(tiny_artifacts, name):
    """With mixed-step graphs on, prefill and mixed prefill + decode steps replay the graph of
    their token bucket (captured at start), padded by one sequence, also when they run as many
    sequences as a step may: the logits rows and KV writes equal an eager executor's; a step
    the graphs cannot hold (more logits rows than sequences) runs eagerly."""
    from trtc.runtime.executors.cuda_executor import CudaExecutor

    art = Artifact.open(tiny_artifacts[name])
    eager = CudaExecutor(art, num_blocks=64, mixed_graphs=False)
    graphed = CudaExecutor(art, num_blocks=64, mixed_graphs=True)
    assert eager.decode.graphs and not eager.mixed.graphs
    assert max(graphed.decode.graphs) == 8 and graphed.mixed.seqs == 9  # 8 running and the padding
    assert sorted(graphed.mixed.graphs) == [128, 192, 256]  # above 9 seqs, at most 256 tokens
    eager_runs = []
    forward = graphed.forward
    graphed.forward = lambda feeds: eager_runs.append(1) or forward(feeds)
    prompts = [list(range(5, 45)), list(range(100, 117)), list(range(3, 9))]
    tables = [[0, 1, 2, 3], [10, 11, 12], [20, 21]]
    eight = [[41 + 2 * i, 42 + 2 * i] for i in range(8)]
    steps = [
        ([SequenceWork(p, 0, t) for p, t in zip(prompts, tables)], False),  # 63 tokens: 128
        (
            [
                SequenceWork([7], len(prompts[0]), tables[0]),
                SequenceWork(list(range(60, 210)), 0, list(range(30, 40))),  # 150-token chunk
                SequenceWork([8, 9, 10], len(prompts[1]), tables[1], num_logits=3),
                SequenceWork([11], len(prompts[2]), tables[2]),
            ],
            False,
        ),  # 155 tokens: bucket 192
        # 8 sequences, the most a step runs: the graph's ninth is the padding one.
        ([SequenceWork(list(range(i, i + 20)), 0, eight[i]) for i in range(8)], False),
        # 7 sequences verifying two drafts and a new prompt: 22 logits rows, more than the
        # graphs' 9: eager.
        (
            [SequenceWork([i, i + 1, i + 2], 20, eight[i], num_logits=3) for i in range(7)]
            + [SequenceWork(list(range(100, 200)), 0, list(range(57, 64)))],
            True,
        ),
    ]
    for work, runs_eagerly in steps:
        step = make_step(work, 16)
        eager_runs.clear()
        a, b = eager.execute(step), graphed.execute(step)
        assert bool(eager_runs) == runs_eagerly
        assert b.shape == a.shape
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(graphed.kv_pool, eager.kv_pool, atol=1e-5, rtol=1e-5)


def test_deferred_graphs_are_captured_one_at_a_time_and_used_as_they_come(tiny_artifacts):
    """A server's executor captures the one-sequence decode graph and the smallest prefill /
    mixed-step graph at start and the rest after, a piece at a time (a graph's warm-up, then
    its capture), decode first, each kind largest first: meanwhile a decode step of several
    sequences replays the smallest mixed-step graph, a longer prefill runs eagerly, and a step
    replays the smallest captured graph that holds it (the same logits and KV writes)."""
    from trtc.runtime.executors.cuda_executor import CudaExecutor

    art = Artifact.open(tiny_artifacts["tiny-llama"])
    eager = CudaExecutor(art, num_blocks=64, mixed_graphs=False)
    graphed = CudaExecutor(art, num_blocks=64, mixed_graphs=True, defer_graphs=True)
    assert sorted(graphed.decode.graphs) == [1] and sorted(graphed.mixed.graphs) == [128]
    assert "5 after ready" in graphed.startup.notes["graphs"]  # decode 8, 4, 2; mixed 256, 192
    eager_runs = []
    forward = graphed.forward
    graphed.forward = lambda feeds: eager_runs.append(1) or forward(feeds)
    tables = [list(range(0, 7)), list(range(10, 14))]
    seen = []
    # At start; decode 8, 4, 2 and the warm-up of mixed 256 (a step between a graph's two
    # pieces); its capture; mixed 192.
    for pieces in (0, 7, 1, 2):
        for _ in range(pieces):
            more = graphed.capture_deferred()
        assert not pieces or more == (pieces != 2)
        prompts = [[(pieces * 7 + i) % 200 + 1 for i in range(100)], list(range(100, 157))]
        prefill = [SequenceWork(p, 0, t) for p, t in zip(prompts, tables)]  # 157 tokens
        decode = [SequenceWork([9], len(p), t) for p, t in zip(prompts, tables)]
        for work in (prefill, decode):
            step = make_step(work, 16)
            eager_runs.clear()  # (a capture runs the forward too)
            a, b = eager.execute(step), graphed.execute(step)
            seen.append(bool(eager_runs))
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(graphed.kv_pool, eager.kv_pool, atol=1e-5, rtol=1e-5)
        seen.append((sorted(graphed.decode.graphs), sorted(graphed.mixed.graphs)))
    assert seen == [
        True, False, ([1], [128]),
        True, False, ([1, 2, 4, 8], [128]),
        False, False, ([1, 2, 4, 8], [128, 256]),
        False, False, ([1, 2, 4, 8], [128, 192, 256]),
    ]  # fmt: skip
    assert graphed.capture_deferred() is False
    with graphed.graphs_set_aside():  # what trtc tune runs its serving shapes with, too
        eager_runs.clear()
        graphed.execute(make_step(decode, 16))
        assert eager_runs
    eager_runs.clear()
    graphed.execute(make_step(decode, 16))
    assert not eager_runs


# tiny-qwen3: per-head q/k norms, its layers left to the unfused rotary and cache write.
@pytest.mark.parametrize("name", ["tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
def test_greedy_generation_same_on_gpu_and_cpu(tiny_artifacts, name):
    prompts = [[1, 2, 3, 4, 5] * 6, list(range(40, 90)), [200, 201]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    cpu = LLM(tiny_artifacts[name], executor="torch", num_blocks=64).generate(prompts, params)
    gpu = LLM(tiny_artifacts[name], executor="cuda", num_blocks=64).generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


def test_async_scheduling_on_the_gpu_gives_the_same_tokens(tiny_artifacts):
    """Steps queued ahead take their input tokens from the previous step's sampled ids on the
    GPU (graph replays); requests of different lengths end while a step is queued ahead; a
    seeded request draws on the GPU from its own generator, ahead or not."""
    prompts = [list(range(10, 50)), [7, 8, 9], list(range(100, 130)), [200] * 12]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 5, 17)]
    params.append(SamplingParams(max_tokens=9, temperature=0.8, top_k=50, seed=5, ignore_eos=True))
    runs = []
    for on in (False, True):
        llm = LLM(tiny_artifacts["tiny-llama"], executor="cuda", num_blocks=64, async_scheduling=on)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert (llm.engine.stats().counters.ahead_steps > 0) == on
        assert llm.engine.block_manager.num_free_blocks == 64
    assert runs[0] == runs[1]
    assert [len(t) for t in runs[1]] == [30, 5, 17, 9]
