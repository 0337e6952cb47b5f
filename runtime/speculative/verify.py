"""Verification: which drafts the target model accepts, keeping its distribution exactly.

The target ran on the sequence's last token and its ``k`` drafts, so ``logits[i]`` is its
distribution for the token after draft ``i`` (row 0: after the last verified token).

- Greedy (temperature 0): a draft is accepted while it equals the target's argmax at its place;
  the first mismatch is replaced by the argmax, and if all ``k`` pass the argmax after the last
  draft comes free. The output is then exactly what one token a step would have given.
- Sampling: the rejection rule of Leviathan et al. and Chen et al. (2023). Draft ``d`` drawn
  from ``q`` is accepted with probability ``min(1, p(d) / q(d))``; at the first rejection a
  token is drawn from the residual ``max(0, p - q)`` (normalised) and the rest are dropped; if
  all pass, one more is drawn from ``p`` after the last draft. Every emitted token is then
  distributed as the target's ``p`` (temperature, top-k, top-p applied as `Sampler` applies
  them). A proposer that does not sample (n-gram lookup) has ``q`` a point mass at its token.
  Draws use the request's generator, so a seeded request is reproducible.
"""

from __future__ import annotations

import torch

from trtc.runtime.core.proposal import Proposal
from trtc.runtime.core.sampler import Sampler
from trtc.runtime.core.sampling_params import SamplingParams


def acceptance_probability(p_token: torch.Tensor, q_token: torch.Tensor) -> torch.Tensor:
    """The chance to keep a draft the target gives ``p_token`` and the proposer ``q_token``."""
    return torch.clamp(p_token / q_token, max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where to draw from after a rejection: the target's mass the proposer under-covers."""
    return torch.clamp(p - q, min=0.0)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` (unnormalised is fine): the exponential race, as `Sampler`."""
    q = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / q).argmax())


def verify(
    logits: torch.Tensor,
    proposal: Proposal,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens a step emits for a sequence that verified ``proposal``: the accepted drafts,
    then one token from the target (a correction or the free token after the last draft).
    ``logits``: ``[k + 1, vocab]``."""
    k = len(proposal)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{logits.shape[0]} logits rows to verify {k} drafts (need {k + 1})")
    if params.temperature == 0:
        target = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < k and proposal.tokens[accepted] == target[accepted]:
            accepted += 1
        return proposal.tokens[:accepted] + [target[accepted]]
    p = Sampler._probs([params] * (k + 1), logits.float())
    emitted = []
    for i, draft in enumerate(proposal.tokens):
        if proposal.probs is None:
            q = torch.zeros_like(p[i])
            q[draft] = 1.0
        else:
            q = proposal.probs[i].to(p.device, torch.float32)
        u = torch.rand((), generator=generator, device=p.device)
        if u < acceptance_probability(p[i, draft], q[draft]):
            emitted.append(draft)
            continue
        left = residual(p[i], q)
        emitted.append(_draw(left if left.sum() > 0 else p[i], generator))
        return emitted
    emitted.append(_draw(p[k], generator))
    return emitted
