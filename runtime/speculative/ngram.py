"""Prompt lookup: propose what followed the last time the sequence's latest tokens occurred.

The last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) are looked up in the sequence's
own tokens, prompt and output; at the most recent earlier match, the tokens that followed it are
the proposal. No model runs: the proposal costs a search of the sequence, and it pays where the
output quotes its input (summaries, revisions, code edits, extraction)."""

from __future__ import annotations

from trtc.runtime.core.proposal import Proposal
from trtc.runtime.core.sequence import Sequence


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``tokens``' last
    ``n``-gram, for the longest ``n`` in ``[min_n, max_n]`` that occurs; [] if none does."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        # Latest start first: the most recent context is the likeliest to repeat.
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer:
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n ({min_n}) <= max_n ({max_n})")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Proposal]:
        return [
            Proposal(lookup(seq.token_ids, k, self.min_n, self.max_n) if k > 0 else [])
            for seq, k in zip(seqs, max_tokens)
        ]

    def verified(self, seq: Sequence) -> None:
        pass

    def finished(self, seq: Sequence) -> None:
        pass
