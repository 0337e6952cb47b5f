"""The padded layout of a prefill / mixed-step graph (`MixedStepInputs`), checked on the CPU:
the graph as compiled, run on the padded inputs, gives the step's logits rows and KV writes."""

from __future__ import annotations

import pytest
import torch

from trtc.artifact import Artifact
from trtc.contract import SequenceWork, make_step
from trtc.runtime.executors.step_buffers import MixedStepInputs
from trtc.runtime.executors.torch_executor import TorchExecutor

PROMPTS = [list(range(5, 45)), list(range(100, 117)), list(range(3, 9))]
TABLES = [[0, 1, 2, 3], [10, 11, 12], [20, 21]]
CPU = torch.device("cpu")


def mixed_steps():
    """A prefill of three prompts, then a step mixing a new prompt's chunk, two decodes and a
    sequence verifying two drafts (three logits rows)."""
    yield make_step([SequenceWork(p, 0, t) for p, t in zip(PROMPTS, TABLES)], 16)
    yield make_step(
        [
            SequenceWork([7], len(PROMPTS[0]), TABLES[0]),
            SequenceWork(list(range(60, 81)), 0, [30, 31]),  # a new prompt's first chunk
            SequenceWork([8, 9, 10], len(PROMPTS[1]), TABLES[1], num_logits=3),
            SequenceWork([11], len(PROMPTS[2]), TABLES[2]),
        ],
        16,
    )


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_padded_mixed_step_gives_the_steps_logits_and_kv(tiny_artifacts, name):
    art = Artifact.open(tiny_artifacts[name])
    plain = TorchExecutor(art, num_blocks=40)
    padded = TorchExecutor(art, num_blocks=40)
    inputs = MixedStepInputs(tokens=128, seqs=8, max_blocks=8, block_size=16, device=CPU)
    for step in mixed_steps():
        assert inputs.fits(step)
        want = plain.forward(step.as_dict())
        rows = inputs.load(step)
        got = padded.forward(dict(inputs.tensors))
        assert got.shape[0] == inputs.num_seqs and rows == step.logits_indices.shape[0]
        torch.testing.assert_close(got[:rows], want, atol=1e-4, rtol=1e-4)
        # The padding writes no KV: the pools agree everywhere, block 0 included.
        torch.testing.assert_close(padded.kv_pool, plain.kv_pool, atol=1e-5, rtol=1e-5)


def test_steps_a_graph_cannot_hold_are_refused():
    inputs = MixedStepInputs(tokens=128, seqs=4, max_blocks=8, block_size=16, device=CPU)
    long = make_step([SequenceWork(list(range(1, 130)), 0, list(range(9)))], 16)
    assert not inputs.fits(long)  # more tokens than the bucket (and a wider block table)
    wide = make_step([SequenceWork([1], 140, list(range(9)))], 16)
    assert not inputs.fits(wide)  # a block table wider than the graph's
    four = make_step([SequenceWork([1, 2], 0, [i]) for i in range(4)], 16)
    assert not inputs.fits(four)  # no sequence left for the padding
    three = make_step([SequenceWork([1, 2], 0, [i]) for i in range(3)], 16)
    assert inputs.fits(three)
    with pytest.raises(ValueError, match="more tokens"):
        MixedStepInputs(tokens=64, seqs=64, max_blocks=4, block_size=16, device=CPU)
    with pytest.raises(ValueError, match="block table"):
        MixedStepInputs(tokens=128, seqs=4, max_blocks=4, block_size=16, device=CPU)
