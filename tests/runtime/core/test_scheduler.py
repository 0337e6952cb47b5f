"""In-flight batching with chunked prefill and preemption, driven by a fake model
(`harness.fake_model`).

The fake model keeps a token-valued "KV pool": each step writes every new token into its slot, and
reads a sequence's context back from the slots of its block table. Its next token is a function of
that context, so a stale block, a wrong prefix-cache hit or a lost token after preemption changes
the output, which the tests compare with a run that had room for everything.
"""

from __future__ import annotations

import pytest

from harness.fake_model import EOS, make, run, seq
from trtc.contract import make_step
from trtc.runtime.core.sequence import SamplingParams, Sequence, SequenceStatus


def test_chunked_prefill_splits_a_long_prompt():
    sched, model = make(budget=32)
    s = seq("long", 100, max_tokens=3)
    sched.add(s)
    chunks = []
    for _ in range(4):
        batch = sched.schedule()
        chunks.append([r.num_new_tokens for r in batch])
        sched.postprocess(batch, model.step(batch))
    assert chunks == [[32], [32], [32], [4]]
    assert s.num_output_tokens == 1  # a token only once the whole prompt was computed
    run(sched, model)
    assert s.finish_reason == "length" and s.num_output_tokens == 3
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_step_mixes_decode_tokens_and_a_prefill_chunk():
    sched, model = make(budget=32)
    a = seq("a", 10, max_tokens=20)
    sched.add(a)
    batch = sched.schedule()
    sched.postprocess(batch, model.step(batch))  # a is decoding now
    sched.add(seq("b", 100, start=500))
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a", "b"]
    assert [r.num_new_tokens for r in batch] == [1, 31]
    assert [r.samples for r in batch] == [True, False]
    sched.postprocess(batch, model.step(batch))
    assert a.num_output_tokens == 2 and sched.num_waiting == 0 and sched.num_running == 2


def test_short_request_added_after_a_long_one_finishes_first():
    sched, model = make(budget=32)
    long, short = seq("long", 100, max_tokens=30), seq("short", 5, max_tokens=3, start=700)
    sched.add(long)
    order = []
    for _ in range(2):
        batch = sched.schedule()
        sched.postprocess(batch, model.step(batch))
    sched.add(short)
    while sched.has_unfinished():
        batch = sched.schedule()
        order += [s.request_id for s in sched.postprocess(batch, model.step(batch))]
    assert order == ["short", "long"]
    assert long.num_output_tokens == 30 and short.num_output_tokens == 3


def test_long_prefill_threshold_lets_a_short_request_start_during_a_long_prefill():
    sched, model = make(budget=32, long_prefill_threshold=16)
    long, short = seq("long", 100, max_tokens=2), seq("short", 5, max_tokens=2, start=700)
    sched.add(long)
    sched.add(short)
    batch = sched.schedule()
    assert [r.num_new_tokens for r in batch] == [16, 5]
    sched.postprocess(batch, model.step(batch))
    assert short.num_output_tokens == 1 and long.num_output_tokens == 0


def test_preemption_lets_more_requests_than_fit_all_finish():
    # 8 requests of up to 6 + 12 - 1 = 17 tokens (5 blocks) each; the pool holds 10 blocks.
    def requests():
        return [seq(f"r{i}", 6, max_tokens=12, start=100 * i) for i in range(8)]

    sched, model = make(num_blocks=10, block_size=4, max_num_seqs=8, budget=64)
    reqs = requests()
    for r in reqs:
        sched.add(r)
    run(sched, model)
    assert sched.num_preemptions > 0
    assert all(r.finish_reason == "length" and r.num_output_tokens == 12 for r in reqs)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(r == 0 for r in bm.ref_counts)

    # Preemption and recomputation do not change a single token.
    roomy, roomy_model = make(num_blocks=200, block_size=4, budget=64)
    reference = requests()
    for r in reference:
        roomy.add(r)
    run(roomy, roomy_model)
    assert roomy.num_preemptions == 0
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in reference]


def test_preempted_sequence_goes_back_to_the_front_and_recomputes_everything():
    sched, model = make(num_blocks=4, block_size=4, max_num_seqs=3, budget=64)
    a, b = seq("a", 4, max_tokens=9), seq("b", 4, max_tokens=9, start=300)  # 3 blocks each at most
    c = seq("c", 2, max_tokens=2, start=600)
    d = seq("d", 2, max_tokens=2, start=800)  # waits: max_num_seqs
    for s in (a, b, c, d):
        sched.add(s)
    preempted = []
    while not preempted:
        batch = sched.schedule()
        preempted = batch.preempted
        if batch.preempted:
            break
        sched.postprocess(batch, model.step(batch))
    victim = preempted[0]
    assert victim is not a and victim.status is SequenceStatus.WAITING  # the newest gives way
    assert victim.block_table == [] and victim.num_computed_tokens == 0
    assert list(sched.waiting) == [victim, d]  # ahead of those that never ran
    assert victim.num_output_tokens > 0  # keeps what it generated ...
    assert all(s is not victim for s in batch.seqs)
    sched.postprocess(batch, model.step(batch))
    run(sched, model)
    assert all(s.is_finished for s in (a, b, c, d))
    # ... and recomputes it: one later step ran its prompt and generated tokens.
    assert victim.num_output_tokens == victim.params.max_tokens


def test_request_that_can_never_fit_is_rejected():
    sched, _ = make(num_blocks=4, block_size=4)
    sched.add(seq("fits", 10, max_tokens=7))  # 16 KV slots: the last token is never fed back
    with pytest.raises(ValueError, match="needs 5 KV blocks.*pool has 4"):
        sched.add(seq("too-big", 10, max_tokens=8))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(seq("fits", 3))
    with pytest.raises(ValueError, match="top_p"):
        sched.add(seq("bad", 3, top_p=0.0))
    assert sched.num_waiting == 1


def test_abort_waiting_and_running_frees_blocks():
    sched, model = make(num_blocks=64, block_size=16, max_num_seqs=1, budget=64)
    running, waiting = seq("run", 40, max_tokens=10), seq("wait", 40, max_tokens=10, start=900)
    sched.add(running)
    sched.add(waiting)
    batch = sched.schedule()
    assert batch.seqs == [running] and running.block_table and sched.num_waiting == 1
    assert sched.abort("wait") is waiting
    assert waiting.finish_reason == "abort" and waiting.is_finished and sched.num_waiting == 0
    assert sched.abort("run") is running
    assert running.finish_reason == "abort" and running.block_table == []
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert sched.abort("run") is None and not sched.has_unfinished()
    # The step that was in flight when "run" was aborted comes back: it is ignored.
    assert sched.postprocess(batch, [11]) == []
    assert running.num_output_tokens == 0
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_max_num_seqs_is_respected():
    sched, model = make(num_blocks=200, max_num_seqs=3, budget=256)
    reqs = [seq(f"r{i}", 5, max_tokens=4, start=50 * i) for i in range(10)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert len(batch) == 3 and sched.num_running == 3 and sched.num_waiting == 7
    sched.postprocess(batch, model.step(batch))
    batches = run(sched, model)  # run() asserts the limit on every step
    assert max(len(b) for b in batches) == 3
    assert all(r.num_output_tokens == 4 for r in reqs)


def test_shared_prefix_is_computed_once():
    sched, model = make(num_blocks=64, block_size=16, budget=256)
    prefix = list(range(1000, 1064))
    a = Sequence("a", prefix + [1, 2, 3], SamplingParams(max_tokens=2))
    b = Sequence("b", prefix + [4, 5], SamplingParams(max_tokens=2))
    sched.add(a)
    batch = sched.schedule()
    sched.postprocess(batch, model.step(batch))
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and [r.num_new_tokens for r in batch] == [
        1,
        2,
    ]  # b only runs its own 2 tokens
    assert b.num_cached_prefix_tokens == 64 and b.block_table[:4] == a.block_table[:4]
    sched.postprocess(batch, model.step(batch))
    run(sched, model)
    bm = sched.block_manager
    assert bm.prefix_cache_hits == 64
    assert bm.num_free_blocks == bm.num_blocks


def test_stop_conditions():
    sched, model = make()
    eos = seq("eos", 3, max_tokens=10)
    ignore = seq("ignore", 3, max_tokens=3, start=200, ignore_eos=True)
    stop_id = seq("stop-id", 3, max_tokens=10, start=300, stop_token_ids=(77,), ignore_eos=True)
    for s in (eos, ignore, stop_id):
        sched.add(s)
    batch = sched.schedule()
    assert sched.postprocess(batch, [11, 12, 13]) == []
    batch = sched.schedule()
    finished = sched.postprocess(batch, [EOS, EOS, 77])
    assert finished == [eos, stop_id]
    assert eos.finish_reason == "stop" and eos.output_token_ids == [11, EOS]
    assert stop_id.finish_reason == "stop" and stop_id.output_token_ids == [13, 77]
    batch = sched.schedule()
    assert batch.seqs == [ignore]
    assert sched.postprocess(batch, [EOS]) == [ignore]
    assert ignore.finish_reason == "length" and ignore.output_token_ids == [12, EOS, EOS]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_engine_finish_on_stop_string_frees_blocks():
    sched, model = make()
    s = seq("s", 20, max_tokens=50)
    sched.add(s)
    batch = sched.schedule()
    sched.postprocess(batch, model.step(batch))
    sched.finish(s, "stop")
    assert s.finish_reason == "stop" and s.block_table == [] and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_work_is_valid_for_the_step_contract():
    sched, _ = make(num_blocks=64, block_size=16, budget=48)
    for i, n in enumerate((30, 7, 50)):
        sched.add(seq(f"r{i}", n, start=100 * i))
    batch = sched.schedule()
    assert [r.num_new_tokens for r in batch] == [30, 7, 11]
    step = make_step(batch.to_work(), 16)
    assert step.query_start_loc.tolist() == [0, 30, 37, 48]
    assert step.context_lens.tolist() == [30, 7, 11]
    assert step.input_ids.tolist()[30:37] == list(range(100, 107))
    for s, w in zip(batch.seqs, batch.to_work()):
        assert len(w.block_table) * 16 >= w.num_cached + len(w.new_tokens)
        assert w.block_table == s.block_table


BUCKETS = (16, 32, 64, 128)


def _decoding(sched, model, n):
    """``n`` sequences past their prompts (one step of 4-token prompts), decoding."""
    seqs = [seq(f"d{i}", 4, max_tokens=40, start=200 + 10 * i) for i in range(n)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    sched.postprocess(batch, model.step(batch))
    return seqs


def test_a_step_just_above_a_token_bucket_is_cut_down_to_it():
    """3 decode rows + a 70-token prompt = 73 tokens, which the executor would pad to 128: the
    prompt's chunk gives its last 9 tokens to the next step (9 deferred < 55 padded)."""
    outputs = {}
    for buckets in (BUCKETS, ()):
        sched, model = make(num_blocks=128, budget=256, token_buckets=buckets)
        decoding = _decoding(sched, model, 3)
        prompt = seq("p", 70, max_tokens=5, start=600)
        sched.add(prompt)
        batch = sched.schedule()
        if buckets:
            assert [r.num_new_tokens for r in batch] == [1, 1, 1, 61] and batch.num_tokens == 64
            assert [r.samples for r in batch] == [True, True, True, False]
            sched.postprocess(batch, model.step(batch))
            assert prompt.num_computed_tokens == 61 and prompt.num_output_tokens == 0
            nxt = sched.schedule()  # 12 tokens: no bucket between the 4 rows and them
            assert [r.num_new_tokens for r in nxt] == [1, 1, 1, 9] and [r.samples for r in nxt][-1]
            sched.postprocess(nxt, model.step(nxt))
        else:
            assert [r.num_new_tokens for r in batch] == [1, 1, 1, 70]
            sched.postprocess(batch, model.step(batch))
        run(sched, model)
        outputs[buckets] = [s.output_token_ids for s in (*decoding, prompt)]
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert outputs[BUCKETS] == outputs[()]  # the same tokens, computed in other steps


@pytest.mark.parametrize(
    "prompt_len,want",
    [
        (117, 117),  # 120 tokens: 56 to defer against 8 of padding, kept whole
        (130, 130),  # 133 tokens: above the last bucket, run eagerly without padding
        (61, 61),  # 64 tokens: a bucket exactly
        (70, 61),  # 73 tokens: cut (the test above)
    ],
)
def test_a_step_is_cut_only_where_it_defers_fewer_tokens_than_it_pads(prompt_len, want):
    sched, model = make(num_blocks=128, budget=256, token_buckets=BUCKETS)
    _decoding(sched, model, 3)
    sched.add(seq("p", prompt_len, max_tokens=2, start=600))
    assert [r.num_new_tokens for r in sched.schedule()] == [1, 1, 1, want]


def test_a_step_is_not_cut_where_its_last_row_would_keep_no_token():
    """1 decode row + prompts of 34 and 5 tokens: 40 tokens, 8 above the 32 bucket (against 24
    of padding), but the last row has only 5."""
    sched, model = make(num_blocks=128, budget=256, token_buckets=BUCKETS)
    _decoding(sched, model, 1)
    sched.add(seq("a", 34, max_tokens=2, start=600))
    sched.add(seq("b", 5, max_tokens=2, start=700))
    assert [r.num_new_tokens for r in sched.schedule()] == [1, 34, 5]
