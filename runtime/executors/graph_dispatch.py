"""Which captured graph a step replays, from its shape alone: the CUDA executor's dispatcher.

A step of one token a sequence replays the decode graph of the smallest captured batch that
holds its sequences. A step of a few tokens a sequence (verifying drafts) replays the
multi-token graph of that batch and its tokens' bucket (`MULTI_TOKEN_BUCKETS`), captured on
first use, when the batch is small (`MULTI_TOKEN_MAX_SEQS`) and its input ids come from the host
(the multi-token layout moves each token to its sequence's slot on the host). Any other step
replays the prefill / mixed-step graph of the smallest captured token bucket that holds it, if
that graph's sequences, logits rows and block tables do (`MixedStepInputs.fits`); otherwise it
runs eagerly. A graph not captured yet (``defer_graphs``) is not picked: a step then takes the
next larger one, or runs eagerly."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trtc.contract import StepInputs
    from trtc.runtime.executors.cuda_graphs import (
        DecodeGraphs,
        GraphFamily,
        MixedGraphs,
        VerifyGraphs,
    )

# Tokens per sequence of the multi-token steps captured as graphs (a sequence verifying K
# drafts runs K + 1: K = 1, 2, 4, 8), each sequence's tokens padded to the bucket.
MULTI_TOKEN_BUCKETS = (2, 3, 5, 9)
# Only for steps of few sequences (speculation's, by its off-rule): a graph's logits cover every
# padded token, and a wide one would take memory the KV pool was sized without.
MULTI_TOKEN_MAX_SEQS = 16


def multi_token_bucket(step: StepInputs) -> int | None:
    """The smallest `MULTI_TOKEN_BUCKETS` entry that holds the step's longest sequence (in new
    tokens); None when none does."""
    most = int((step.query_start_loc[1:] - step.query_start_loc[:-1]).max())
    i = bisect_left(MULTI_TOKEN_BUCKETS, most)
    return MULTI_TOKEN_BUCKETS[i] if i < len(MULTI_TOKEN_BUCKETS) else None


class GraphDispatcher:
    """Picks the graph family and size a step replays (None: it runs eagerly), reading the
    families' captured sizes as they are at each step."""

    def __init__(self, decode: DecodeGraphs, verify: VerifyGraphs, mixed: MixedGraphs):
        self.decode, self.verify, self.mixed = decode, verify, mixed

    def dispatch(self, step: StepInputs, device_ids: bool) -> tuple[GraphFamily, Hashable] | None:
        """``(family, size)`` of the graph ``step`` replays, or None. ``device_ids``: the step's
        first input ids come from the device (the previous step's sampled tokens)."""
        num_tokens, num_seqs = step.num_tokens, step.num_seqs
        batch = self.decode.pick(num_seqs)
        if batch is not None:
            if num_tokens == num_seqs:  # one token a sequence
                return self.decode, batch
            # The per-sequence maximum is read only for the steps that may use it.
            if batch <= MULTI_TOKEN_MAX_SEQS and not device_ids:
                tokens = multi_token_bucket(step)
                if tokens is not None:
                    return self.verify, (batch, tokens)
        tokens = self.mixed.pick(num_tokens)
        if tokens is not None and self.mixed.graphs[tokens].inputs.fits(step):
            return self.mixed, tokens
        return None
