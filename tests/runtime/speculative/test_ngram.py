"""Prompt lookup proposes what followed the latest earlier occurrence of the longest n-gram."""

from __future__ import annotations

import pytest

from trtc.runtime.core.sequence import Sequence
from trtc.runtime.speculative.ngram import NgramProposer, lookup


@pytest.mark.parametrize(
    "tokens,k,expect",
    [
        ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),  # the 3-gram 1 2 3 was followed by 9
        ([1, 2, 3, 4, 7, 2, 3, 5, 2, 3], 3, [5, 2, 3]),  # the latest occurrence wins
        ([5, 6, 7, 8], 3, []),  # nothing repeats
        ([4, 4], 3, [4]),  # a run proposes itself, as far as it is known
    ],
)
def test_lookup(tokens, k, expect):
    assert lookup(tokens, k, min_n=1, max_n=3) == expect


def test_longer_ngrams_win_over_shorter_ones():
    # "3" alone was last followed by 8; "2 3" was followed by 4.
    assert lookup([2, 3, 4, 3, 8, 2, 3], 1, min_n=1, max_n=2) == [4]
    assert lookup([2, 3, 4, 3, 8, 2, 3], 1, min_n=1, max_n=1) == [8]


def test_proposer_respects_each_sequence_limit():
    seqs = [Sequence("a", [1, 2, 1, 2, 1]), Sequence("b", [1, 2, 1, 2, 1])]
    proposals = NgramProposer().propose(seqs, [3, 0])
    assert [p.tokens for p in proposals] == [[2, 1], []]  # what followed, as far as known
    assert proposals[0].probs is None  # a point mass: the rejection rule's q is 1 at the draft
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(min_n=3, max_n=2)
