"""From sampled tokens to what a client sees: incremental detokenization, stop strings, and the
`RequestOutput` of each step (its new tokens and text since the previous one)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the server's side detokenizes too, and imports no torch)
    from trtc.runtime.core.sequence import Sequence
try:
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the window method only
    Tokenizer = DecodeStream = None
from trtc.runtime.engine.outputs import RequestOutput


class IncrementalDetokenizer:
    """A sequence's text, extended as its tokens arrive, without decoding its whole output
    again. A token's text can depend on its neighbours (byte-level BPE pieces of one UTF-8
    character, SentencePiece's leading spaces). With a Rust-backed tokenizer, the `tokenizers`
    library's `DecodeStream` keeps that state (one call a token, about a tenth of the cost of
    the window below: the server's engine detokenizes every token it streams). Otherwise, as
    vLLM's v0 did: the new text is the decode of a short window minus the decode of the same
    window without the newest tokens. ``backend``: `stream_backend(tokenizer)`, decided once
    per tokenizer by the caller."""

    def __init__(self, tokenizer, backend: Tokenizer | None):
        self.tokenizer = tokenizer
        self.text = ""
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # tokens whose text is already in self.text
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True) if backend is not None else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int], start: int = 0) -> str:
        """Feed the whole output so far (``ids[start:]``: a sequence's tokens after its
        prompt, read in place); returns the text it adds (may be empty while an incomplete
        UTF-8 character waits for its remaining bytes)."""
        if self._stream is not None:
            new = ids[start + self.read_offset :]  # copies the new tokens only
            try:
                delta = "".join(p for t in new if (p := self._stream.step(self._backend, t)))
            except Exception:  # a sequence the stream cannot decode: windows from here on
                self._stream = None
                self.prefix_offset = self.read_offset = len(ids) - start
                full = self._decode(ids[start:])
                delta = full[len(self.text) :] if full.startswith(self.text) else ""
                self.text += delta
                return delta
            self.read_offset += len(new)
            self.text += delta
            return delta
        ids = ids[start:] if start else ids
        before = self._decode(ids[self.prefix_offset : self.read_offset])
        after = self._decode(ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self.text += delta
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return delta

    def finish(self, ids: list[int]) -> str:
        """The text once the sequence ended (not by an abort, whose text is what was
        streamed): its whole output ``ids`` decoded, the bytes still waiting for the rest of
        a character flushed as they are."""
        self.text = self._decode(ids)
        return self.text


def stream_backend(tokenizer) -> Tokenizer | None:
    """The Rust tokenizer to stream-decode with, or None where the streamed text could differ
    from ``tokenizer.decode``: no Rust backend, spaces cleaned up after decoding, or a
    byte-fallback decoder (SentencePiece-style ``<0x..>`` tokens: the stream refuses some byte
    sequences a model can sample, and text it has sent can decode differently once the bytes
    after it arrive)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if DecodeStream is None or not isinstance(backend, Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if backend.decoder is not None and b'"ByteFallback"' in backend.decoder.__getstate__():
        return None  # (the decoder's own JSON, not the whole tokenizer's)
    return backend


@dataclass
class _RequestState:
    """Output state of one request: its text so far and what has been handed out."""

    text: IncrementalDetokenizer
    sent_tokens: int = 0
    sent_text: int = 0
    first_token_time: float | None = None
    stopped: bool = False
    prompt_ids: list[int] | None = None  # copied once, not at every output


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._backend = stream_backend(tokenizer)
        self._states: dict[str, _RequestState] = {}

    def add(self, request_id: str) -> None:
        self._states[request_id] = _RequestState(
            IncrementalDetokenizer(self.tokenizer, self._backend)
        )

    def first_token(self, seq: Sequence, now: float) -> bool:
        """Record the time of ``seq``'s first token; whether this was it."""
        state = self._states[seq.request_id]
        if state.first_token_time is not None:
            return False
        state.first_token_time = now
        return True

    def hits_stop_string(self, seq: Sequence) -> bool:
        """Extend the text by the new token; True when it completes one of the request's stop
        strings (the text is then cut before it, as OpenAI's API does; the caller finishes the
        sequence)."""
        if not (seq.params.detokenize or seq.params.stop):
            return False
        state = self._states[seq.request_id]
        delta = state.text.update(seq.token_ids, seq.num_prompt_tokens)
        if not delta:
            return False
        text = state.text.text
        for stop in seq.params.stop:
            at = text.find(stop, max(0, len(text) - len(delta) - len(stop) + 1))
            if at >= 0:
                state.text.text = text[:at]
                state.stopped = True
                return True
        return False

    def output(self, seq: Sequence) -> RequestOutput:
        """What ``seq`` produced since its previous output; a finished request's state is
        dropped."""
        state = self._states[seq.request_id]
        finished = seq.is_finished
        if (
            finished
            and not state.stopped
            and seq.finish_reason != "abort"
            and (seq.params.detokenize or seq.params.stop)
        ):
            state.text.finish(seq.output_token_ids)
        text = state.text.text
        delta = text[state.sent_text :]
        output_ids = seq.output_token_ids  # a copy
        new_ids = output_ids[state.sent_tokens :]
        state.sent_text, state.sent_tokens = len(text), len(output_ids)
        if state.prompt_ids is None:
            state.prompt_ids = seq.token_ids[: seq.num_prompt_tokens]
        out = RequestOutput(
            seq.request_id,
            state.prompt_ids,
            output_ids,
            text,
            new_ids,
            delta,
            finished,
            seq.finish_reason,
            seq.num_cached_prefix_tokens,
            seq.arrival_time,
            state.first_token_time,
            time.monotonic() if finished else None,
        )
        if finished:
            del self._states[seq.request_id]
        return out
