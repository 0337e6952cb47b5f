"""The OpenAI wire format trtc serves: request bodies (the subset trtc takes), response bodies,
their streamed chunks, and error bodies.

Requests parse into pydantic models (`parse_request`); anything the server cannot take becomes an
`OpenAIError`, which the app turns into ``{"error": {...}}`` with a 4xx/5xx status. Responses are
pydantic models too, built from the engine's `RequestOutput` by a `CompletionFormat` or a
`ChatFormat`; their fields and their order are those of OpenAI's API, so the official clients
read them (``"logprobs": null`` included, ``"finish_reason": null`` while a stream runs)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic_core import to_json

from trtc.runtime.core.sampling_params import SamplingParams
from trtc.runtime.engine.outputs import RequestOutput

# --- errors --------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class OpenAIError(Exception):
    """A request the server refuses, with its HTTP status; its body is an `ErrorResponse`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


# pydantic names union members and validators in an error's location ('prompt.str',
# 'prompt.list[int]', 'function-after'); clients want the field path only.
_TYPE_TAGS = frozenset(
    ("str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-plain")
)


def validation_error(e: ValidationError) -> OpenAIError:
    """The first problem pydantic found (in `e.errors()`, which FastAPI's
    RequestValidationError has too), as a 400 naming the parameter by its dotted path."""
    first = e.errors()[0]
    loc = [
        str(p)
        for p in first["loc"]
        if p != "body" and not (isinstance(p, str) and ("[" in p or p.lower() in _TYPE_TAGS))
    ]
    param = ".".join(loc) or None
    if first["type"] == "json_invalid":
        return OpenAIError(400, f"the request body is not valid JSON: {first['msg']}")
    if first["type"] == "missing":
        return OpenAIError(400, f"missing required parameter: '{param}'", param)
    return OpenAIError(
        400, f"invalid value for '{param}': {first['msg']} (got {first.get('input')!r})", param
    )


RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(raw: bytes, model_cls: type[RequestT]) -> RequestT:
    """A request body as `model_cls`; malformed JSON, a non-object or a bad field is a 400."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


# --- requests ------------------------------------------------------------------------------

# What a request may carry beyond the fields trtc implements. Nothing else is taken: a field
# trtc would ignore changes what the client gets without telling it (JSON asked for, free text
# returned), so any other field is a 400 naming it.
# - Bookkeeping that changes nothing trtc returns: taken and ignored.
IGNORED_REQUEST_FIELDS = frozenset(
    (
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "parallel_tool_calls",  # says how to call tools, and no tool is taken (below)
    )
)
# - Features trtc does not implement, taken only at the value that asks for nothing (what a
#   client that sends every default sends).
NEUTRAL_REQUEST_VALUES: dict[str, tuple] = {
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "top_logprobs": (None, 0),
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "min_tokens": (None, 0),
    "best_of": (None, 1),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
}
# A chat message's: its author's name (the chat templates of the families trtc serves do not
# read it) and a tool result's call id are ignored; tool calls only when there are none.
IGNORED_MESSAGE_FIELDS = frozenset(("name", "tool_call_id"))
NEUTRAL_MESSAGE_VALUES: dict[str, tuple] = {
    "tool_calls": (None, []),
    "function_call": (None,),
    "refusal": (None,),
    "audio": (None,),
}


def refuse_unimplemented(
    extra: dict | None, ignored: frozenset[str], neutral: dict[str, tuple], where: str = ""
) -> None:
    """A 400 for the first field of ``extra`` (what a request carries beyond the fields of its
    model) that is neither ``ignored`` nor at one of its ``neutral`` values; ``where`` prefixes
    the parameter's name (``messages``)."""
    for name, value in (extra or {}).items():
        if name in ignored or value in neutral.get(name, ()):
            continue
        param = f"{where}.{name}" if where else name
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        if name in neutral:
            allowed = " or ".join("null" if v is None else json.dumps(v) for v in neutral[name])
            message = (
                f"'{param}' is not supported by trtc: only {allowed} is accepted (got {shown}); "
                "remove it from the request"
            )
        else:
            message = f"unknown parameter '{param}' (got {shown}); remove it from the request"
        raise OpenAIError(400, message, param)


class SamplingFields(BaseModel):
    """The fields both endpoints share: the model and how to sample."""

    # Fields beyond these are collected, then refused unless harmless (`refuse_unimplemented`).
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
    # extension: false keeps this request out of speculative decoding (`trtc serve --speculative`)
    speculative: bool = True
    # extension (vLLM's name): each choice, and each streamed chunk's, carries its token ids, so
    # a client counts tokens whose text is empty (a multi-byte character's first bytes)
    return_token_ids: bool = False
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @model_validator(mode="after")
    def _no_unimplemented_fields(self):
        refuse_unimplemented(self.model_extra, IGNORED_REQUEST_FIELDS, NEUTRAL_REQUEST_VALUES)
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The engine's parameters; what trtc does not implement is refused, not ignored."""
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
            speculative=self.speculative,
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

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); a batch of several is refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(
                    400, "send one prompt per request (batched prompts are not supported)", "prompt"
                )
            prompt = prompt[0]
        return prompt

    def check_supported(self) -> None:
        if self.echo or self.suffix:
            raise OpenAIError(
                400, "echo and suffix are not supported", "echo" if self.echo else "suffix"
            )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # then refused unless harmless, as a request's
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    @model_validator(mode="after")
    def _no_unimplemented_fields(self):
        refuse_unimplemented(
            self.model_extra, IGNORED_MESSAGE_FIELDS, NEUTRAL_MESSAGE_VALUES, "messages"
        )
        return self

    def text(self) -> str:
        """The content as one string; only text parts are taken."""
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

    def conversation(self) -> list[dict]:
        """The messages as a chat template takes them ('developer' is the newer 'system')."""
        return [
            {"role": m.role if m.role != "developer" else "system", "content": m.text()}
            for m in self.messages
        ]


# --- responses -----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served by the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, out: RequestOutput) -> Usage:
        prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens),
        )


class ResponseHead(BaseModel):
    """What every response body and chunk of one request opens with."""

    id: str
    object: str
    created: int
    model: str


class Choice(BaseModel):
    """One choice (trtc gives one): `index`, then its subclass's payload (text, message or
    delta), the ``token_ids`` extension when asked for, then ``"logprobs": null`` and
    `finish_reason` (null while a stream runs)."""

    index: int = 0
    token_ids: list[int] | None = None  # with ``return_token_ids``: this choice's (or chunk's)
    logprobs: None = None
    finish_reason: str | None = None

    @model_serializer(mode="wrap")
    def _in_openai_order(self, handler):
        data = handler(self)
        head = {"index": data.pop("index")}
        token_ids = data.pop("token_ids")
        tail = {"logprobs": data.pop("logprobs"), "finish_reason": data.pop("finish_reason")}
        return head | data | ({} if token_ids is None else {"token_ids": token_ids}) | tail


class CompletionChoice(Choice):
    text: str


class CompletionChunk(ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionResponse(CompletionChunk):
    """A whole completion: the shape of its chunks, with the usage."""

    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(Choice):
    message: AssistantMessage


class ChatCompletionResponse(ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """A streamed piece of the assistant's message; unset fields are left out (``{}`` when a
    step added no text)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(Choice):
    delta: ChatDelta


class ChatCompletionChunk(ResponseHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class UsageChunk(ResponseHead):
    """A stream's last chunk when the client asked for ``stream_options.include_usage``."""

    choices: list = []
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "trtc"
    max_model_len: int  # extension: prompt + completion tokens, at most
    vocab_size: int  # extension
    special_token_ids: list[int]  # extension: `trtc bench --url` leaves them out of its prompts


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    running: int
    waiting: int


class HealthFailure(BaseModel):
    status: Literal["error"] = "error"
    error: str


# --- writing a request's outputs -----------------------------------------------------------


# Stands for a chunk's text while its JSON frame is rendered (`ResponseFormat.chunk_json`):
# private-use characters, which JSON leaves as they are.
_TEXT_MARK = "\ue000trtc-text\ue000"
_TEXT_MARK_JSON = to_json(_TEXT_MARK).decode()


class ResponseFormat:
    """Writes one request's outputs in its endpoint's shape: the whole response, or one chunk per
    output, opened by `opening()` and closed by `usage_chunk` when asked for."""

    id_prefix: str
    chunk_object: str

    def __init__(self, request_id: str, model: str, token_ids: bool = False):
        self.head = {
            "id": f"{self.id_prefix}-{request_id}",
            "created": int(time.time()),
            "model": model,
        }
        self.token_ids = token_ids  # the ``return_token_ids`` extension
        self._text_frame: tuple[str, str] | None = None  # see chunk_json

    def chunk_json(self, out: RequestOutput) -> str:
        """The JSON of ``chunk(out)``. The chunks of a running request that carry text and no token
        ids (a streaming server writes one a token a stream: most of what it writes) differ
        only in their text, so their JSON around the text is rendered once, by the models, and
        each chunk is that frame around its text's JSON: the same bytes, without building and
        serializing the models each time (7-12 us a chunk on a development CPU, about 1 now)."""
        if out.finished or self.token_ids or not out.delta_text:
            return self.chunk(out).model_dump_json()
        if self._text_frame is None:
            marked = self.chunk(replace(out, delta_text=_TEXT_MARK)).model_dump_json()
            before, mark, after = marked.partition(_TEXT_MARK_JSON)
            assert mark and _TEXT_MARK_JSON not in after, marked
            self._text_frame = (before, after)
        before, after = self._text_frame
        return before + to_json(out.delta_text).decode() + after

    def ids(self, token_ids: list[int]) -> list[int] | None:
        """What a choice carries as ``token_ids``: these when asked for, else nothing."""
        return list(token_ids) if self.token_ids else None

    def response(self, out: RequestOutput) -> BaseModel:
        raise NotImplementedError

    def chunk(self, out: RequestOutput) -> BaseModel:
        raise NotImplementedError

    def opening(self) -> list[BaseModel]:
        return []

    def usage_chunk(self, out: RequestOutput) -> UsageChunk:
        return UsageChunk(**self.head, object=self.chunk_object, usage=Usage.of(out))


def _finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


class CompletionFormat(ResponseFormat):
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def response(self, out: RequestOutput) -> CompletionResponse:
        choice = CompletionChoice(
            text=out.text, token_ids=self.ids(out.token_ids), finish_reason=_finish_reason(out)
        )
        return CompletionResponse(**self.head, choices=[choice], usage=Usage.of(out))

    def chunk(self, out: RequestOutput) -> CompletionChunk:
        choice = CompletionChoice(
            text=out.delta_text,
            token_ids=self.ids(out.new_token_ids),
            finish_reason=_finish_reason(out),
        )
        return CompletionChunk(**self.head, choices=[choice])


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        choice = ChatChoice(
            message=AssistantMessage(content=out.text),
            token_ids=self.ids(out.token_ids),
            finish_reason=_finish_reason(out),
        )
        return ChatCompletionResponse(**self.head, choices=[choice], usage=Usage.of(out))

    def chunk(self, out: RequestOutput) -> ChatCompletionChunk:
        delta = ChatDelta(content=out.delta_text) if out.delta_text else ChatDelta()
        choice = ChatChunkChoice(
            delta=delta, token_ids=self.ids(out.new_token_ids), finish_reason=_finish_reason(out)
        )
        return ChatCompletionChunk(**self.head, choices=[choice])

    def opening(self) -> list[ChatCompletionChunk]:
        """The assistant's role, before any text (as OpenAI streams it)."""
        delta = ChatDelta(role="assistant", content="")
        return [
            ChatCompletionChunk(
                **self.head,
                choices=[ChatChunkChoice(delta=delta, token_ids=self.ids([]), finish_reason=None)],
            )
        ]
