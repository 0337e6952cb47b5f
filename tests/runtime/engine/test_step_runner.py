"""The step runner on the torch executor: the tokens of the rows that sample (and none for a
prompt chunk that does not end its prompt), the same tokens drawn on the device, a step
queued ahead on ids still on the device, and drafts verified beside plain rows."""

from __future__ import annotations

import pytest

from trtc.artifact import Artifact
from trtc.contract import make_step
from trtc.runtime.core.block_manager import BlockManager
from trtc.runtime.core.proposal import Proposal
from trtc.runtime.core.scheduler import Scheduler
from trtc.runtime.core.sequence import SamplingParams, Sequence
from trtc.runtime.engine.outputs import EngineCounters
from trtc.runtime.engine.step_runner import StepRunner
from trtc.runtime.executors.torch_executor import TorchExecutor
from trtc.runtime.speculative.policy import SpeculationPolicy

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
NEVER = 259  # the tiny vocabulary's last id, which the model does not pick after these prompts


@pytest.fixture
def parts(tiny_artifacts):
    """A torch executor, a scheduler over its pool (no prefix cache: rows of equal prompts
    compute their own blocks) and a runner with a policy that has no proposer."""
    executor = TorchExecutor(Artifact.open(tiny_artifacts["tiny-llama"]), num_blocks=32)
    scheduler = Scheduler(BlockManager(32, executor.block_size, False), 4, 48)
    policy = SpeculationPolicy(None, 4, 8, 256, EngineCounters())
    return executor, scheduler, StepRunner(executor, policy, 4)


def add(scheduler: Scheduler, runner: StepRunner, rid: str, prompt: list[int]) -> Sequence:
    seq = Sequence(rid, prompt, GREEDY)
    scheduler.add(seq)
    runner.add(rid, runner.new_generator(GREEDY))
    return seq


def test_rows_that_end_their_prompt_sample_and_the_device_draws_the_same(parts):
    executor, scheduler, runner = parts
    add(scheduler, runner, "short", list(range(20, 30)))
    add(scheduler, runner, "long", list(range(40, 100)))  # 60 tokens: a 38-token chunk first
    batch = scheduler.schedule()
    assert [r.samples for r in batch] == [True, False]
    logits = executor.execute(make_step(batch.to_work(), executor.block_size))
    on_host = runner.launch(batch)
    assert on_host.device_tokens is None
    assert on_host.tokens() == [int(logits[0].argmax()), None]
    on_device = runner.launch(batch, on_device=True)  # the same step again: the same KV
    assert on_device.device_tokens is not None
    assert on_device.tokens()[0] == on_host.tokens()[0]


def test_a_step_queued_ahead_decodes_the_ids_left_on_the_device(parts):
    executor, scheduler, runner = parts
    seqs = [add(scheduler, runner, rid, list(range(s, s + 12))) for rid, s in (("a", 5), ("b", 50))]
    first = runner.launch(scheduler.schedule(), on_device=True)
    ahead_batch = scheduler.schedule_ahead(first.batch)
    assert ahead_batch is not None and ahead_batch.ahead == 2
    ahead = runner.launch_ahead(ahead_batch, first)
    tokens = first.tokens()
    scheduler.postprocess(first.batch, tokens)
    assert [s.token_ids[-1] for s in seqs] == tokens
    # The step that ran on the device's ids gives what the same step built on the host gives
    # (each sequence's last token, now appended, at its place).
    work = [s.to_work(1) for s in seqs]
    expect = executor.execute(make_step(work, executor.block_size))
    assert ahead.tokens() == expect.argmax(dim=-1).tolist()


def test_drafts_are_verified_beside_a_plain_row(parts):
    """Two sequences of one prompt: one decodes plainly, the other verifies two drafts the
    model rejects. The verifying row emits the plain row's token, and the policy counts it."""
    executor, scheduler, runner = parts
    prompt = list(range(60, 75))
    plain, drafted = (add(scheduler, runner, rid, prompt) for rid in ("plain", "drafted"))
    first = runner.launch(scheduler.schedule())
    scheduler.postprocess(first.batch, first.tokens())
    drafted.proposal = Proposal([NEVER, NEVER])
    batch = scheduler.schedule()
    assert batch.speculative and [r.num_new_tokens for r in batch] == [1, 3]
    tokens = runner.launch(batch).tokens()
    assert isinstance(tokens[0], int) and tokens[1] == [tokens[0]]
    counters = runner.speculation.counters
    assert (counters.spec_proposed_tokens, counters.spec_accepted_tokens) == (2, 0)
    assert drafted.spec_failures == 1
    assert plain.token_ids == drafted.token_ids  # (this step's tokens are not appended yet)
