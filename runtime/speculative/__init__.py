"""Speculative decoding: proposers guess a sequence's next tokens, the target model checks them
all in one step, and verification keeps the target's distribution exactly (`verify.py`).

`make_proposer` turns the ``--speculative`` option into a proposer: ``ngram`` (prompt lookup,
no extra model) or ``draft:DIR`` (a second trtc artifact with the same tokenizer)."""

from __future__ import annotations

from trtc.runtime.core.proposal import Proposal
from trtc.runtime.speculative.ngram import NgramProposer
from trtc.runtime.speculative.proposer import Proposer

__all__ = ["NgramProposer", "Proposal", "Proposer", "make_proposer"]


def make_proposer(spec: str, **draft_options) -> Proposer:
    """``ngram`` or ``draft:DIR``; ValueError naming what is allowed otherwise."""
    if spec == "ngram":
        return NgramProposer()  # needs none of the draft options
    if spec.startswith("draft:") and spec[len("draft:") :]:
        from trtc.runtime.speculative.draft import DraftModelProposer

        return DraftModelProposer(spec[len("draft:") :], **draft_options)
    raise ValueError(f"--speculative {spec!r}: expected 'ngram' or 'draft:ARTIFACT_DIR'")
