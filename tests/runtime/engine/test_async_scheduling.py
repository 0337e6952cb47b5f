"""Async scheduling: step n+1 scheduled and queued before step n's tokens are read
(`Scheduler.schedule_ahead`, `LLMEngine.step`), admitting waiting requests into it. The outputs
must be exactly those of the plain loop, whatever stops, aborts or joins in between; the pool
must end as it started."""

from __future__ import annotations

import pytest

from harness.fake_model import FakeModel, make, run, seq
from trtc.runtime.core.scheduler import Scheduler
from trtc.runtime.core.sequence import SamplingParams, SequenceStatus
from trtc.runtime.engine import EngineConfig, LLMEngine


def run_ahead(sched: Scheduler, model: FakeModel) -> int:
    """The engine's loop with async scheduling, on the fake; returns how many steps went ahead."""
    ahead_steps, queued = 0, None  # queued: (batch, its tokens as the device has them)
    while sched.has_unfinished() or queued:
        launched, queued = queued, None
        if launched is None or not launched[0].has_running():
            batch = sched.schedule()
            if not len(batch):
                break
            launched = (batch, model.step(batch))
        ahead = sched.schedule_ahead(launched[0])
        if ahead is not None:
            rows = ahead.ahead_rows or range(len(launched[1]))
            queued = (ahead, model.step(ahead, input_ids=[launched[1][i] for i in rows]))
            ahead_steps += 1
        batch, tokens = launched
        tokens = [
            t if s.status is SequenceStatus.RUNNING else None for s, t in zip(batch.seqs, tokens)
        ]
        sched.postprocess(batch, tokens)
        sched.block_manager.check_invariants()
    return ahead_steps


def _requests():
    # Different lengths and a stop token id that the fake model produces mid-way for one of them.
    reqs = [
        seq("a", 40, max_tokens=20),
        seq("b", 5, max_tokens=7, start=300),
        seq("c", 70, max_tokens=12, start=500),
        seq("d", 3, max_tokens=1, start=700),
    ]
    plain_sched, plain_model = make(budget=48)
    for r in reqs:
        plain_sched.add(r)
    run(plain_sched, plain_model)
    stop_at = reqs[0].output_token_ids[6]
    return [
        seq("a", 40, max_tokens=20, stop_token_ids=(stop_at,)),
        seq("b", 5, max_tokens=7, start=300),
        seq("c", 70, max_tokens=12, start=500),
        seq("d", 3, max_tokens=1, start=700),
    ]


def _count_cuts(sched) -> list[bool]:
    """Per step scheduled from now on: whether the fit to a token bucket cut it."""
    cuts, fit = [], sched._fit_to_bucket

    def counted(batch):
        before = batch.num_tokens
        fit(batch)
        cuts.append(batch.num_tokens != before)

    sched._fit_to_bucket = counted
    return cuts


@pytest.mark.parametrize("num_blocks", [64, 12])  # 12: short pool, preemption on the way
@pytest.mark.parametrize("token_buckets", [(), (8, 16, 24, 32, 40, 48)])  # one cut down to a bucket
def test_pipelined_loop_gives_the_plain_loops_tokens(num_blocks, token_buckets):
    results = []
    for pipelined in (False, True):
        sched, model = make(num_blocks=num_blocks, budget=48, token_buckets=token_buckets)
        cuts = _count_cuts(sched)
        reqs = _requests()
        for r in reqs:
            sched.add(r)
        if pipelined:
            assert run_ahead(sched, model) > 0
        else:
            run(sched, model)
        results.append([(r.output_token_ids, r.finish_reason) for r in reqs])
        assert sched.block_manager.num_free_blocks == num_blocks
        assert any(cuts) == bool(token_buckets)  # the buckets did cut a step
    assert results[0] == results[1]
    assert results[0][0][1] == "stop" and len(results[0][0][0]) == 7


def test_schedule_ahead_continues_every_row_and_admits_who_waits():
    sched, model = make(budget=32)
    long, short = seq("long", 50, max_tokens=5), seq("short", 4, max_tokens=1, start=900)
    sched.add(long)
    first = sched.schedule()  # a 32-token chunk of 50: it does not sample
    assert sched.schedule_ahead(first) is None
    sched.postprocess(first, model.step(first))
    second = sched.schedule()  # the last chunk samples: next is a decode
    blocks_before = list(long.block_table)
    ahead = sched.schedule_ahead(second)
    assert (
        ahead is not None
        and ahead.ahead
        and ahead.seqs == [long]
        and [r.num_new_tokens for r in ahead] == [1]
    )
    assert (
        len(long.block_table) * 16 >= long.num_tokens + 1
        and long.block_table[: len(blocks_before)] == blocks_before
    )
    sched.postprocess(second, model.step(second))
    sched.add(short)
    # Someone waits: the step after `ahead` decodes long's next token (from the device) and
    # admits short's prompt (from the host) after it.
    after = sched.schedule_ahead(ahead)
    assert after is not None and after.ahead == 1 and after.seqs == [long, short]
    assert [r.num_new_tokens for r in after] == [1, 4] and [r.samples for r in after] == [
        True,
        True,
    ]
    assert not sched.waiting and short.status is SequenceStatus.RUNNING
    work = after.to_work()
    assert work[0].new_tokens == [0] and work[1].new_tokens == short.token_ids


def test_a_prompt_chunk_continues_in_the_step_ahead():
    """A step with a decoding row and a prompt chunk that does not end its prompt goes ahead:
    the decoding row takes its device token, the chunk continues after the tokens the running
    step computes (not yet counted by the host)."""
    sched, model = make(budget=16)
    a, b = seq("a", 4, max_tokens=5), seq("b", 40, max_tokens=2, start=600)
    sched.add(a)
    first = sched.schedule()
    sched.postprocess(first, model.step(first))  # a decodes now
    sched.add(b)
    second = sched.schedule()
    assert [r.num_new_tokens for r in second] == [1, 15] and [r.samples for r in second] == [
        True,
        False,
    ]
    second_tokens = model.step(second)
    third = sched.schedule_ahead(second)  # queued before second's tokens are read
    assert third is not None and third.ahead == 1 and third.ahead_rows == [0]
    assert (
        third.seqs == [a, b]
        and [r.num_new_tokens for r in third] == [1, 15]
        and [r.pending for r in third] == [0, 15]
    )
    work = third.to_work()
    assert work[1].num_cached == 15 and work[1].new_tokens == b.token_ids[15:30]
    third_tokens = model.step(third, input_ids=[second_tokens[0]])  # b's KV checked by the fake
    sched.postprocess(second, second_tokens)
    fourth = sched.schedule_ahead(third)  # b's last 10 tokens: it samples
    assert (
        fourth.seqs == [a, b]
        and [r.pending for r in fourth] == [0, 15]
        and [r.samples for r in fourth] == [True, True]
    )
    model.step(fourth, input_ids=[third_tokens[0]])
    sched.postprocess(third, third_tokens)
    assert b.num_computed_tokens == 30 and a.num_output_tokens == 3


def test_rows_of_sequences_that_ended_are_left_out_of_the_step_ahead():
    """A sequence that ended (here: aborted) while a step was queued ahead is not in the step
    after it, which still goes ahead for the others, each on its own row's device token."""
    plain_sched, plain_model = make(budget=32)
    ref = seq("b", 6, max_tokens=6, start=400)
    plain_sched.add(ref)
    run(plain_sched, plain_model)
    sched, model = make(budget=32)
    a, b = seq("a", 4, max_tokens=6), seq("b", 6, max_tokens=6, start=400)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    first_tokens = model.step(first)
    second = sched.schedule_ahead(first)  # queued before the first step's tokens are read
    second_tokens = model.step(second, input_ids=first_tokens)
    sched.postprocess(first, first_tokens)
    sched.abort("a")
    third = sched.schedule_ahead(second)
    assert third.ahead == 1 and third.ahead_rows == [1] and third.seqs == [b]
    third_tokens = model.step(third, input_ids=[second_tokens[1]])  # b's KV checked by the fake
    sched.postprocess(second, second_tokens)
    sched.postprocess(third, third_tokens)
    assert b.output_token_ids == ref.output_token_ids[:3]


def test_prompts_that_end_in_the_step_go_ahead_together():
    sched, _ = make(budget=32)
    a, b = seq("a", 10, max_tokens=3), seq("b", 3, max_tokens=1, start=950)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()  # both prompts whole: both sample
    ahead = sched.schedule_ahead(batch)
    assert ahead is not None and ahead.seqs == [
        a,
        b,
    ]  # b ends by length: its row is wasted, not wrong


def test_nothing_goes_ahead_when_every_row_ends_by_length():
    sched, model = make()
    a, b = seq("a", 4, max_tokens=1), seq("b", 6, max_tokens=1, start=200)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert sched.schedule_ahead(batch) is None


def _engine_outputs(artifact, pipelined: bool, stop_token: int, abort_after: int | None = None):
    engine = LLMEngine(
        artifact,
        EngineConfig(
            executor="torch", num_blocks=48, async_scheduling=pipelined, max_num_batched_tokens=40
        ),
    )
    greedy = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, greedy) for p in ("one two three", "a much longer prompt " * 3)]
    ids.append(
        engine.add_request(
            "stop me",
            SamplingParams(
                max_tokens=14, temperature=0, ignore_eos=True, stop_token_ids=(stop_token,)
            ),
        )
    )
    outs, reasons, steps = {}, {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        steps += 1
        if steps == 3:
            ids.append(engine.add_request("joins later", greedy))
        if steps == abort_after:
            assert (engine._ahead is not None) == pipelined, (
                "the abort should meet a step queued ahead"
            )
            reasons[ids[0]] = engine.abort(ids[0]).finish_reason
    assert engine.block_manager.num_free_blocks == 48
    engine.block_manager.check_invariants()
    return [(outs.get(i), reasons[i]) for i in ids], engine.stats().counters.ahead_steps


@pytest.mark.parametrize("abort_after", [None, 6])
def test_engine_async_scheduling_gives_the_same_tokens(tiny_artifacts, abort_after):
    art = tiny_artifacts["tiny-llama"]
    free_run, _ = _engine_outputs(art, False, stop_token=10**6)  # never produced: learn the tokens
    stop_token = free_run[2][0][4]  # "stop me" stops at its 5th token
    plain, plain_ahead = _engine_outputs(art, False, stop_token, abort_after)
    pipelined, ahead = _engine_outputs(art, True, stop_token, abort_after)
    assert plain_ahead == 0 and ahead > 0
    assert pipelined == plain
    stop_run = free_run[2][0]
    assert plain[2] == (stop_run[: stop_run.index(stop_token) + 1], "stop")
    if abort_after:
        assert plain[0][1] == "abort" and len(plain[0][0]) < 14


def test_drawn_tokens_go_ahead_and_stay_reproducible(tiny_artifacts):
    """Seeded draws happen on the executor's device, from the request's own generator: queued
    ahead or not, the same tokens."""
    art = tiny_artifacts["tiny-llama"]
    runs = []
    for pipelined in (False, True):
        engine = LLMEngine(
            art, EngineConfig(executor="torch", num_blocks=32, async_scheduling=pipelined)
        )
        ids = [
            engine.add_request(
                p,
                SamplingParams(
                    max_tokens=n, temperature=0.8, top_p=0.9, seed=7 + n, ignore_eos=True
                ),
            )
            for p, n in (("seeded", 10), ("another one", 4))
        ]
        ids.append(
            engine.add_request(
                "greedy", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            )
        )
        tokens = {i: [] for i in ids}
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
        runs.append([tokens[i] for i in ids])
        assert (engine.stats().counters.ahead_steps > 0) == pipelined
    assert runs[0] == runs[1] and [len(t) for t in runs[0]] == [10, 4, 6]


# On the GPU the admitted rows' ids and the previous step's device ids meet in the CUDA graphs'
# inputs (a mixed-step graph, then decode graphs).
@pytest.mark.parametrize("executor", ["torch", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_requests_that_arrive_while_steps_run_are_admitted_ahead(tiny_artifacts, executor):
    """A request added while a step is queued ahead goes into the step after it (queued ahead
    too), its prompt from the host and the running rows' tokens from the device; a prompt
    longer than the step's budget is admitted by a chunk that samples nothing. Seeded or
    greedy, the tokens are the plain loop's."""
    art = tiny_artifacts["tiny-llama"]
    arrivals = {
        2: ("short arrival", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),
        4: (
            "a long arrival " * 8,  # more than the 24-token budget: two chunks
            SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True),
        ),
    }
    runs, admitted_ahead = [], []
    for pipelined in (False, True):
        engine = LLMEngine(
            art,
            EngineConfig(
                executor=executor,
                num_blocks=48,
                async_scheduling=pipelined,
                max_num_batched_tokens=24,
            ),
        )
        first = engine.add_request(
            "running", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        )
        ids, tokens, steps = [first], {}, 0
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            steps += 1
            if steps in arrivals:
                ids.append(engine.add_request(*arrivals[steps]))
            elif pipelined and steps - 1 in arrivals and engine._ahead is not None:
                queued = engine._ahead.batch
                admitted_ahead.append(
                    ids[-1] in [s.request_id for s in queued.seqs[queued.ahead :]]
                )
        runs.append([tokens[i] for i in ids])
        assert engine.block_manager.num_free_blocks == 48
    assert runs[0] == runs[1] and [len(t) for t in runs[0]] == [16, 8, 6]
    assert admitted_ahead == [True, True]  # each arrival went into a step queued ahead
