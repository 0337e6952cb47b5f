"""The streamed chunks' JSON: what `ResponseFormat.chunk_json` writes from its cached frame is
byte for byte what the models write, for any text."""

from __future__ import annotations

import json

import pytest

from trtc.runtime.engine.outputs import RequestOutput
from trtc.runtime.serving.protocol import ChatFormat, CompletionFormat

TEXTS = [
    " word",
    'a "quoted" \\ backslash / slash',
    "line\nbreak\ttab\r",
    "".join(chr(c) for c in range(32)) + "\x7f",
    "é ü ß — “curly” 漢字 \U0001f600",
    "\ufffd",  # a partial character's replacement
    "\ue000trtc-text\ue000",  # the frame's own placeholder, as a model's text
    "</script>&<>'",
]


def output(text: str, *, finished: bool = False, new: list[int] | None = None) -> RequestOutput:
    return RequestOutput(
        "req-7", [1, 2, 3], [4, 5], "so far" + text, new or [5], text, finished,
        "length" if finished else None,
    )  # fmt: skip


@pytest.mark.parametrize("fmt_cls", [CompletionFormat, ChatFormat])
@pytest.mark.parametrize("token_ids", [False, True])
def test_chunk_json_is_the_models_json(fmt_cls, token_ids):
    fmt = fmt_cls("req-7", "tiny-llama", token_ids)
    outputs = [output(t) for t in TEXTS]
    outputs += [output(""), output("", new=[]), output("end", finished=True)]
    for out in outputs:
        expected = fmt.chunk(out).model_dump_json()
        assert fmt.chunk_json(out) == expected
        chunk = json.loads(expected)
        choice = chunk["choices"][0]
        text = choice["text"] if fmt_cls is CompletionFormat else choice["delta"].get("content", "")
        assert text == out.delta_text
    assert (fmt._text_frame is not None) is (not token_ids)  # the frame serves plain chunks
