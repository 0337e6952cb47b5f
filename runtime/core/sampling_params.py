"""How a request is sampled and when it stops: plain data, checked once, free of torch (a
server's front end builds and checks them without the engine's imports)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # the caller seeds a per-request torch.Generator from it
    stop: tuple[str, ...] = ()  # stop strings: matched by the engine, which detokenizes
    stop_token_ids: tuple[int, ...] = ()  # stop even when ignore_eos is set
    ignore_eos: bool = False
    detokenize: bool = True  # False: token ids only (benchmarks), unless stop strings need text
    speculative: bool = True  # may be verified with drafts when the engine speculates

    def __post_init__(self):
        # Lists (as JSON gives them) become tuples, so the params stay hashable and immutable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first bad field, its value and what is allowed; else
        return self."""

        def bad(field: str, allowed: str):
            raise ValueError(f"{field}={getattr(self, field)!r} is invalid: must be {allowed}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if not _is_real(self.temperature) or not (0 <= self.temperature < math.inf):
            bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0 = off)")
        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            bad("top_p", "a number in (0, 1]")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            bad("seed", "an integer in [-2**63, 2**64) or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a tuple of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a tuple of integers >= 0")
        return self


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
