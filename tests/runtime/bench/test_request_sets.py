"""Request sets are reproducible from their spec: random tokens without the special ones, or
windows of a real text."""

from __future__ import annotations

import pytest

from trtc.artifact import Artifact
from trtc.corpus import default_text
from trtc.runtime.bench.request_sets import make_requests, request_set
from trtc.runtime.engine.tokenizer import load_tokenizer

SPEC = {"n": 12, "prompt_len": (8, 40), "output_len": (4, 24), "seed": 0}
TEXT_SPEC = {**SPEC, "text": default_text()}


def test_random_prompts_are_seeded_and_leave_out_reserved_tokens():
    requests = make_requests(vocab=64, reserved={0, 1, 2}, **SPEC)
    assert requests == make_requests(vocab=64, reserved={0, 1, 2}, **SPEC)
    assert requests != make_requests(vocab=64, reserved={0, 1, 2}, **{**SPEC, "seed": 1})
    assert len(requests) == 12
    for r in requests:
        assert 8 <= len(r.prompt_ids) <= 40 and 4 <= r.max_tokens <= 24
        assert all(3 <= t < 64 for t in r.prompt_ids)
    assert request_set(SPEC, 64, {0, 1, 2}) == requests


def test_real_text_prompts_are_windows_of_the_text(tiny_artifacts):
    tokenizer = load_tokenizer(Artifact.open(tiny_artifacts["tiny-llama"]).tokenizer_dir)
    text = default_text()
    requests = request_set(TEXT_SPEC, 512, set(), tokenizer)
    again = request_set(TEXT_SPEC, 512, set(), tokenizer)
    assert [r.prompt_ids for r in requests] == [r.prompt_ids for r in again]  # seeded
    assert len({tuple(r.prompt_ids) for r in requests}) == 12
    for r in requests:
        assert 8 <= len(r.prompt_ids) <= 40 and 4 <= r.max_tokens <= 24
        assert tokenizer.decode(r.prompt_ids) in text
    with pytest.raises(ValueError, match="too short for prompts of up to 40"):
        request_set({**SPEC, "text": "too short"}, 512, set(), tokenizer)
