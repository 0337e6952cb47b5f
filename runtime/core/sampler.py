"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A token is drawn with the exponential race (argmax of p / q, q ~ Exp(1) drawn over the vocabulary in
its own order), which picks token i with probability p_i. The draw depends only on the row's
probabilities and its generator, never on the other rows of the batch or on whether the row was
sorted, so a seeded request gives the same tokens whatever it is batched with.
"""

from __future__ import annotations

import torch

from trtc.runtime.core.sampling_params import SamplingParams


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The per-request generator of a seeded request (None: draw from torch's global one)."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def rows_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-row tensor on ``device``, without waiting for the device: a GPU gets it
    through pinned memory (a copy from pageable memory would synchronise the stream)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """One token per row of ``logits`` [S, vocab] (see `sample_on_device`)."""
        return self.sample_on_device(logits, params, generators).tolist()

    def sample_on_device(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Token ids ``[S]`` int64 on the logits' device, queued there without waiting for it:
        greedy rows take the argmax, the others draw with q from their request's generator
        (which lives on the same device) or torch's global one for that device."""
        if logits.dim() != 2 or not (logits.shape[0] == len(params) == len(generators)):
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {len(params)} params "
                f"and {len(generators)} generators"
            )
        ids = self.greedy(logits)
        random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
        if not random_rows:
            return ids
        every_row = len(random_rows) == len(params)
        index = None if every_row else rows_tensor(random_rows, torch.int64, logits.device)
        rows = (logits if every_row else logits.index_select(0, index)).float()
        probs = self._probs([params[i] for i in random_rows], rows)
        q = torch.empty_like(probs).exponential_()
        for j, i in enumerate(random_rows):
            if generators[i] is not None:  # a seeded request draws from its own stream only
                q[j] = torch.empty_like(probs[j]).exponential_(generator=generators[i])
        drawn = (probs / q).argmax(dim=-1)
        return drawn if every_row else ids.index_copy(0, index, drawn)

    @staticmethod
    def greedy(logits: torch.Tensor) -> torch.Tensor:
        """Each row's most likely token id, on the logits' device (int64)."""
        return logits.argmax(dim=-1)

    def sample_with_logprobs(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> tuple[list[int], list[float]]:
        """One token per row, and its log-probability under the model's raw distribution
        (before temperature, top-k and top-p, as OpenAI's ``logprobs`` reports it)."""
        tokens = self.sample(logits, params, generators)
        chosen = torch.tensor(tokens, device=logits.device)[:, None]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, chosen)[:, 0]
        return tokens, logprobs.tolist()

    @staticmethod
    def _probs(params: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
        """Temperature, then top-k, then top-p (on what top-k kept), as probabilities."""
        vocab, device = logits.shape[-1], logits.device
        temperature = rows_tensor([p.temperature for p in params], logits.dtype, device)
        logits = logits / temperature[:, None]
        if any(0 < p.top_k < vocab or p.top_p < 1 for p in params):  # decided on the host
            top_k = rows_tensor(
                [p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64, device
            )
            top_p = rows_tensor([p.top_p for p in params], logits.dtype, device)
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=logits.device)
            drop = rank[None, :] >= top_k[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
            # Nucleus: keep the smallest set whose mass reaches top_p: drop a token when the mass
            # before it already does (never the first: nothing is before it, and top_p > 0).
            # top_p = 1 keeps all, whatever rounding does to the cumulative sum.
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
            sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
            logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
        return logits.softmax(dim=-1)
