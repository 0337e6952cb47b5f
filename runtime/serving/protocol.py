"""OpenAI-compatible request bodies (the subset trtc serves) and error bodies."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from trtc.runtime.core.sequence import SamplingParams


class OpenAIError(Exception):
    """Becomes ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status,
            message,
            param,
            type,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class SamplingFields(BaseModel):
    # OpenAI clients send fields trtc does not use (user, frequency_penalty=0, ...): accept them.
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, description="tokens to generate (default 16)")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (vLLM's)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []  # extension
    ignore_eos: bool = False  # extension, for benchmarks
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.n != 1:
            raise OpenAIError(
                400, f"n={self.n} is not supported: trtc returns one choice per prompt (n=1)", "n"
            )
        if self.logprobs not in (None, False, 0):
            raise OpenAIError(400, "logprobs are not supported", "logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise OpenAIError(400, f"{name} is not supported (only 0)", name)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise OpenAIError(400, f"at most 4 stop sequences are allowed, got {len(stop)}", "stop")
        if any(not s for s in stop):
            raise OpenAIError(400, "stop sequences must be non-empty strings", "stop")
        if not 0 <= self.temperature <= 2:
            raise OpenAIError(
                400,
                f"temperature={self.temperature} is out of range: must be in [0, 2]",
                "temperature",
            )
        params = SamplingParams(
            max_tokens=16 if max_tokens is None else max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )
        try:
            return params.validate()
        except ValueError as e:
            param = str(e).split("=", 1)[0] if "=" in str(e) else None
            raise OpenAIError(400, str(e), param) from None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise OpenAIError(
                        400,
                        f"content part of type {part.get('type')!r} is not supported "
                        "(this model reads text only)",
                        "messages",
                    )
                parts.append(str(part.get("text", "")))
            return "".join(parts)
        return self.content or ""


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
