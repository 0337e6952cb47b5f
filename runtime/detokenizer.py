"""Incremental detokenization: each step decodes only the last few tokens of a sequence (as vLLM
does), not its whole output again. A token's text can depend on its neighbours (byte-level BPE
pieces of one UTF-8 character, SentencePiece's leading spaces), so the new text is the decode of a
short window minus the decode of the same window without the newest tokens."""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self.prefix_offset = 0      # window start
        self.read_offset = 0        # tokens whose text is already in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int]) -> str:
        """Feed the whole output so far; returns the text it adds (may be empty while an
        incomplete UTF-8 character waits for its remaining bytes)."""
        before = self._decode(ids[self.prefix_offset:self.read_offset])
        after = self._decode(ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self.text += delta
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return delta
