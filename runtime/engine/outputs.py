"""What the engine hands out: per-request outputs, a summary of each step, and a snapshot of
its state (`EngineStats`) that the server's health and metrics read."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace


class RequestError(ValueError):
    """A request the engine cannot take (too long, bad parameters); the message says why."""


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str  # generated text so far (stop string excluded)
    new_token_ids: list[int]  # since the previous output of this request
    delta_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @classmethod
    def aborted(cls, request_id: str) -> RequestOutput:
        """The end of a request whose stream must end without the engine's own last output
        (a failed engine, an abort that failed)."""
        return cls(request_id, [], [], "", [], "", True, "abort")

    def then(self, later: RequestOutput) -> RequestOutput:
        """``later`` as if this output had not been read: its new tokens and text follow this
        one's (a stream that fell behind sends the outputs waiting for it as one)."""
        return replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            delta_text=self.delta_text + later.delta_text,
        )


@dataclass(frozen=True)
class StepSummary:
    """One step as it ran: sequences and tokens, how many were prefilling or decoding (counted
    before the step advanced them), who was preempted to make room, and whether it was queued
    ahead of the previous step's tokens."""

    num_seqs: int
    num_tokens: int
    prefill_seqs: int
    decode_seqs: int
    preempted: list[str] = field(default_factory=list)
    ahead: bool = False

    @property
    def kind(self) -> str:
        if self.prefill_seqs and self.decode_seqs:
            return "mixed"
        return "decode" if self.decode_seqs else "prefill"


@dataclass
class EngineCounters:
    """Totals since the engine started."""

    steps: int = 0
    mixed_steps: int = 0
    ahead_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Speculative decoding: drafts verified, drafts accepted, and sequences that verified
    # drafts in a step (accepted / verifications = mean accepted drafts per step).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0

    def since(self, earlier: EngineCounters) -> EngineCounters:
        """What was counted after ``earlier`` (a copy of these counters taken then)."""
        return EngineCounters(
            **{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)}
        )

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verifying sequence gained per step (accepted drafts + 1); None without
        verifications."""
        if not self.spec_verifications:
            return None
        return 1 + self.spec_accepted_tokens / self.spec_verifications


@dataclass(frozen=True)
class EngineStats:
    """The engine's state after its last step."""

    executor: str  # torch | cuda | tensorrt
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    block_size: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens served from the cache
    num_preemptions: int
    counters: EngineCounters
