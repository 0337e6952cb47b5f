"""Which captured graph a step replays (`GraphDispatcher`), rule by rule, on the CPU: the graph
families hold static inputs on the CPU and stand-ins for their captured graphs (the rules read
only which sizes are captured and the mixed-step inputs' `fits`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trtc.contract import SequenceWork, make_step
from trtc.runtime.executors.cuda_graphs import (
    CapturedGraph,
    DecodeGraphs,
    MixedGraphs,
    VerifyGraphs,
)
from trtc.runtime.executors.graph_dispatch import GraphDispatcher, multi_token_bucket

CPU = torch.device("cpu")
MAX_BLOCKS = 16  # a block table holds 256 tokens: the largest mixed bucket here


def unused_forward(feeds):
    raise AssertionError("the dispatcher runs no step")


def dispatcher(
    decode=(1, 2, 4, 8, 16, 32), mixed=(128, 256), seqs=33, captured=None
) -> GraphDispatcher:
    """Decode graphs of batches ``decode``, mixed-step graphs of buckets ``mixed`` over
    ``seqs`` sequences; of those, the sizes in ``captured`` (default: all) are captured."""
    families = (
        DecodeGraphs(unused_forward, CPU, MAX_BLOCKS, list(decode)),
        MixedGraphs(unused_forward, CPU, MAX_BLOCKS, list(mixed), seqs, 16, vocab_size=8),
    )
    for family in families:
        for size in family.capture_sizes:
            if captured is None or size in captured:
                family.add(size, CapturedGraph(None, family.make_inputs(size), None))
    return GraphDispatcher(families[0], VerifyGraphs(unused_forward, CPU, MAX_BLOCKS), families[1])


def decode(n: int):
    return make_step([SequenceWork([1 + i], 10, [i]) for i in range(n)], 16)


def tokens_each(counts: list[int], logits: int = 1):
    """A step of ``len(counts)`` sequences running ``counts`` new tokens after 10 cached."""
    work = [
        SequenceWork(list(range(1, c + 1)), 10, [2 * i, 2 * i + 1], num_logits=min(logits, c))
        for i, c in enumerate(counts)
    ]
    return make_step(work, 16)


def prefill(tokens: int, seqs: int = 1):
    per = tokens // seqs
    counts = [per] * (seqs - 1) + [tokens - per * (seqs - 1)]
    blocks = -(-max(counts) // 16)
    return make_step(
        [
            SequenceWork(list(range(1, c + 1)), 0, list(range(i * blocks, (i + 1) * blocks)))
            for i, c in enumerate(counts)
        ],
        16,
    )


def picked(d: GraphDispatcher, step, device_ids: bool = False):
    """("decode" | "verify" | "mixed", size), or None (eager), of what ``d`` picks."""
    choice = d.dispatch(step, device_ids)
    if choice is None:
        return None
    family, size = choice
    names = {id(d.decode): "decode", id(d.verify): "verify", id(d.mixed): "mixed"}
    return names[id(family)], size


@pytest.mark.parametrize("seqs,batch", [(1, 1), (3, 4), (16, 16), (17, 32), (32, 32)])
@pytest.mark.parametrize("device_ids", [False, True])
def test_a_decode_step_replays_the_smallest_captured_batch_that_holds_it(seqs, batch, device_ids):
    assert picked(dispatcher(), decode(seqs), device_ids) == ("decode", batch)


def test_a_decode_step_beyond_the_captured_batches_replays_a_mixed_step_graph():
    # Before the larger decode graphs are captured (defer_graphs), and above the largest.
    early = dispatcher(captured={1, 128})
    assert picked(early, decode(1)) == ("decode", 1)
    assert picked(early, decode(3)) == ("mixed", 128)
    assert picked(early, decode(3), device_ids=True) == ("mixed", 128)
    assert picked(dispatcher(mixed=()), decode(33)) is None  # no mixed-step graph: eager


@pytest.mark.parametrize(
    "counts,size",
    [([5, 1, 3], (4, 5)), ([2, 2], (2, 2)), ([3], (1, 3)), ([9], (1, 9)), ([4] * 16, (16, 5))],
)
def test_a_few_tokens_a_sequence_replay_the_verify_graph_of_their_shape(counts, size):
    assert picked(dispatcher(), tokens_each(counts, logits=9)) == ("verify", size)


def test_verify_graphs_take_only_small_batches_with_host_ids_and_short_sequences():
    d = dispatcher()
    assert picked(d, tokens_each([5, 1, 3]), device_ids=True) == ("mixed", 128)
    assert picked(d, tokens_each([2] * 17)) == ("mixed", 128)  # the batch-32 graph: too wide
    assert picked(d, tokens_each([10, 1])) == ("mixed", 128)  # no bucket holds 10 tokens
    # No decode graph holds the batch (none captured yet): no verify graph either.
    assert picked(dispatcher(captured={128}), tokens_each([2, 2])) == ("mixed", 128)
    assert multi_token_bucket(tokens_each([4, 6])) == 9
    assert multi_token_bucket(tokens_each([10])) is None


class Untouchable:
    def __getitem__(self, index):
        raise AssertionError("the per-sequence maximum was read")


@pytest.mark.parametrize(
    "step,device_ids",
    [(decode(3), False), (tokens_each([2, 2]), True), (tokens_each([2] * 17), False)],
)
def test_the_longest_sequence_is_read_only_for_a_verify_candidate(step, device_ids):
    d = dispatcher()
    want = picked(d, step, device_ids)
    step = dataclasses.replace(step, query_start_loc=Untouchable())
    assert picked(d, step, device_ids) == want


def test_prefill_and_mixed_steps_replay_the_smallest_captured_bucket_that_fits():
    d = dispatcher()
    assert picked(d, prefill(63, seqs=3)) == ("mixed", 128)
    assert picked(d, prefill(128)) == ("mixed", 128)
    assert picked(d, prefill(129)) == ("mixed", 256)
    assert picked(dispatcher(captured={1, 256}), prefill(63, seqs=3)) == ("mixed", 256)
    assert picked(d, prefill(257)) is None  # longer than every bucket: eager
    assert picked(dispatcher(mixed=()), prefill(63, seqs=3)) is None


def test_steps_the_mixed_step_graphs_cannot_hold_run_eagerly():
    d = dispatcher()
    assert picked(d, tokens_each([20, 20, 20], logits=20)) is None  # 60 logits rows > 33
    assert picked(d, tokens_each([5] * 33)) is None  # 33 sequences: none left for the padding
    assert picked(d, tokens_each([5] * 32)) == ("mixed", 256)
    wide = make_step([SequenceWork(list(range(1, 20)), 16 * MAX_BLOCKS, [0] * 18)], 16)
    assert picked(d, wide) is None  # a block table wider than the graphs'


def test_graphs_set_aside_are_not_picked_until_they_are_back():
    d = dispatcher()
    with d.decode.set_aside(), d.mixed.set_aside():
        assert picked(d, decode(3)) is None
        assert picked(d, tokens_each([5, 1, 3])) is None  # no decode batch: no verify graph
        assert picked(d, prefill(63, seqs=3)) is None
    assert picked(d, decode(3)) == ("decode", 4)
    assert picked(d, prefill(63, seqs=3)) == ("mixed", 128)
