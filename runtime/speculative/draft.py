"""A draft model: a second, smaller trtc artifact with the target's tokenizer proposes the next
tokens, one cheap step each, run by the same executor machinery with its own KV pool.

For every sequence it drafts for, the proposer keeps a shadow sequence in its own block pool:
the tokens whose K/V the draft has computed. Each round first catches the shadow up with the
target's sequence (the tokens verification accepted since), then drafts ``k`` tokens in ``k``
batched steps: greedy rows take the draft's argmax (a point mass), sampling rows draw from the
draft's distribution under the request's temperature, top-k and top-p, and hand that
distribution to verification. Whatever the target rejected is found at the next round: the
shadow keeps the longest prefix it shares with the target's tokens and gives back the rest.
"""

from __future__ import annotations

import logging

import torch

from trtc.artifact import Artifact
from trtc.contract import make_step
from trtc.errors import ArtifactError
from trtc.runtime.core.block_manager import BlockManager
from trtc.runtime.core.proposal import Proposal
from trtc.runtime.core.sampler import Sampler, make_generator
from trtc.runtime.core.sequence import Sequence, SequenceStatus

log = logging.getLogger("trtc.speculative")


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelProposer:
    name = "draft"

    def __init__(
        self,
        artifact: str,
        tokenizer,
        vocab_size: int,
        executor: str = "auto",
        max_seqs: int = 8,
        kv_cache_memory: int = 1 << 30,
    ):
        """``vocab_size``: the target's logits width (the draft's distributions are given at
        it); ``max_seqs``: sequences drafted for at once (the engine's speculation limit): the
        draft's pool holds that many at full context, within ``kv_cache_memory`` bytes."""
        from trtc.runtime.engine.tokenizer import load_tokenizer
        from trtc.runtime.executors import create_executor, default_num_blocks

        self.artifact = Artifact.open(artifact)
        manifest = self.artifact.manifest
        draft_tokenizer = load_tokenizer(self.artifact.tokenizer_dir)
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                f"--speculative draft:{artifact}: the draft model's tokenizer differs from the "
                "target's (a draft must share the target's vocabulary token for token)"
            )
        if manifest.model.vocab_size > vocab_size:
            raise ValueError(
                f"--speculative draft:{artifact}: the draft's vocabulary "
                f"({manifest.model.vocab_size}) is larger than the target's ({vocab_size})"
            )
        self.vocab_size = vocab_size
        try:
            blocks = default_num_blocks(manifest, kv_cache_memory, max_seqs)
        except ArtifactError as e:
            raise ArtifactError(
                f"--speculative draft:{artifact}: the draft's KV pool: {e}"
            ) from None
        self.executor = create_executor(executor, self.artifact, blocks)
        self.blocks = BlockManager(self.executor.num_blocks, self.executor.block_size, False)
        self.sampler = Sampler()
        self.shadows: dict[str, Sequence] = {}
        self.generators: dict[str, torch.Generator | None] = {}

    # -- the shadow sequences -------------------------------------------------------------------

    def _shadow(self, seq: Sequence) -> Sequence:
        """``seq``'s shadow, caught up: its computed tokens are the longest prefix it shares
        with ``seq``'s tokens, the rest of ``seq``'s tokens are to compute."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.token_ids, seq.params)
            shadow.status = SequenceStatus.RUNNING
            self.shadows[seq.request_id] = shadow
            self.generators[seq.request_id] = make_generator(seq.params, self.executor.device)
            return shadow
        # The last token is always run again: its logits give the first draft.
        keep = min(
            shadow.num_computed_tokens,
            _shared_prefix(shadow.token_ids, seq.token_ids),
            len(seq) - 1,
        )
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = keep
        self.blocks.trim(shadow, keep)
        return shadow

    def finished(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.request_id, None)
        self.generators.pop(seq.request_id, None)
        if shadow is not None:
            self.blocks.free(shadow)

    def verified(self, seq: Sequence) -> None:
        pass  # the next round finds what was accepted (`_shadow`)

    # -- proposing ------------------------------------------------------------------------------

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Proposal]:
        drafts: dict[str, list[int]] = {s.request_id: [] for s in seqs}
        probs: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in seqs}
        active = []
        for seq, k in zip(seqs, max_tokens):
            if k <= 0:
                continue
            shadow = self._shadow(seq)
            if self.blocks.ensure_capacity(shadow, len(shadow) + k):
                active.append((shadow, k))
            else:  # the draft's pool is full: no drafts for this one
                self.finished(seq)
        for round_ in range(max(k for _, k in active) if active else 0):
            rows = [(shadow, k) for shadow, k in active if k > round_]
            work = [s.to_work(s.num_uncomputed_tokens) for s, _ in rows]
            logits = self.executor.execute(make_step(work, self.blocks.block_size))
            tokens = self._draw(logits, [s for s, _ in rows], probs)
            for (shadow, _), token in zip(rows, tokens):
                shadow.num_computed_tokens = len(shadow)
                shadow.append_token(token)
                drafts[shadow.request_id].append(token)
        return [
            Proposal(
                drafts[s.request_id],
                torch.stack(probs[s.request_id]) if probs[s.request_id] else None,
            )
            for s in seqs
        ]

    def _draw(
        self, logits: torch.Tensor, shadows: list[Sequence], probs: dict[str, list[torch.Tensor]]
    ) -> list[int]:
        """Greedy rows: the argmax. Sampling rows: a draw from the draft's distribution, which
        is kept for verification's rejection rule."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, shadow in enumerate(shadows):
            if shadow.params.temperature == 0:
                continue
            q = Sampler._probs([shadow.params], logits[i : i + 1].float())[0]
            race = torch.empty_like(q).exponential_(generator=self.generators[shadow.request_id])
            tokens[i] = int((q / race).argmax())
            # At the target's width: tokens the draft cannot produce have q = 0.
            probs[shadow.request_id].append(
                torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[0]))
            )
        return tokens
