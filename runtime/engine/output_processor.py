"""From sampled tokens to what a client sees: incremental detokenization, stop strings, and the
`RequestOutput` of each step (its new tokens and text since the previous one)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from trtc.runtime.core.sequence import Sequence
from trtc.runtime.engine.outputs import RequestOutput


class IncrementalDetokenizer:
    """Each step decodes only the last few tokens of a sequence (as vLLM does), not its whole
    output again. A token's text can depend on its neighbours (byte-level BPE pieces of one UTF-8
    character, SentencePiece's leading spaces), so the new text is the decode of a short window
    minus the decode of the same window without the newest tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # tokens whose text is already in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int]) -> str:
        """Feed the whole output so far; returns the text it adds (may be empty while an
        incomplete UTF-8 character waits for its remaining bytes)."""
        before = self._decode(ids[self.prefix_offset : self.read_offset])
        after = self._decode(ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self.text += delta
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return delta


@dataclass
class _RequestState:
    """Output state of one request: its text so far and what has been handed out."""

    text: IncrementalDetokenizer
    sent_tokens: int = 0
    sent_text: int = 0
    first_token_time: float | None = None
    stopped: bool = False


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add(self, request_id: str) -> None:
        self._states[request_id] = _RequestState(IncrementalDetokenizer(self.tokenizer))

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
        delta = state.text.update(seq.output_token_ids)
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
            # Bytes still waiting for the rest of a character are flushed as they are.
            state.text.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        text = state.text.text
        delta = text[state.sent_text :]
        new_ids = seq.output_token_ids[state.sent_tokens :]
        state.sent_text, state.sent_tokens = len(text), seq.num_output_tokens
        out = RequestOutput(
            seq.request_id,
            seq.token_ids[: seq.num_prompt_tokens],
            list(seq.output_token_ids),
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
