"""`trtc serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine.

Endpoints: /v1/completions, /v1/chat/completions (both with SSE streaming), /v1/models,
/health, /metrics. Errors are OpenAI-style JSON bodies with 4xx codes; a full server answers 429;
a client that disconnects has its request aborted and its KV blocks freed; SIGTERM stops
accepting new connections and lets in-flight requests finish (uvicorn's graceful shutdown).

This module holds the routes; the wire format is in `protocol`, running a request in `runner`,
and the Prometheus metrics in `metrics`. Routes see the engine through `ServerState`: its
tokenizer, its limits and `engine.stats()`."""

from __future__ import annotations

import logging
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from trtc.runtime.engine.async_engine import AsyncEngine
from trtc.runtime.engine.engine_process import EngineProcess, EngineProcessError
from trtc.runtime.engine.startup import seconds_since_process_start
from trtc.runtime.serving.metrics import EngineMetrics
from trtc.runtime.serving.protocol import (
    ChatCompletionResponse,
    ChatFormat,
    ChatRequest,
    CompletionFormat,
    CompletionRequest,
    CompletionResponse,
    Health,
    HealthFailure,
    ModelCard,
    ModelList,
    OpenAIError,
    SamplingFields,
    parse_request,
    validation_error,
)
from trtc.runtime.serving.runner import respond

if TYPE_CHECKING:
    from trtc.runtime.engine.llm_engine import LLMEngine

log = logging.getLogger("trtc.server")
PUBLIC_PATHS = {"/health", "/metrics"}  # answered without an API key


@dataclass
class ServerState:
    """What the routes share: the engine (in its own process, or in this one), the async
    engine that drives it, the metrics and the API key."""

    engine: LLMEngine | EngineProcess
    async_engine: AsyncEngine
    metrics: EngineMetrics
    api_key: str | None

    @property
    def model_name(self) -> str:
        return self.engine.model_name


def _state(request: Request) -> ServerState:
    return request.app.state.trtc


State = Annotated[ServerState, Depends(_state)]
Body = TypeVar("Body", bound=SamplingFields)


async def _parse(request: Request, model_cls: type[Body], state: ServerState) -> Body:
    """The request body as `model_cls`, for the model this server serves (else 404)."""
    body = parse_request(await request.body(), model_cls)
    if body.model != state.model_name:
        raise OpenAIError(
            404,
            f"the model '{body.model}' does not exist; this server serves '{state.model_name}'",
            "model",
            code="model_not_found",
        )
    return body


router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse)
async def completions(request: Request, state: State):
    body = await _parse(request, CompletionRequest, state)
    params = body.sampling_params(body.max_tokens)
    prompt = body.single_prompt()
    prompt_ids = state.engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    if not prompt_ids:
        raise OpenAIError(400, "the prompt is empty", "prompt")
    body.check_supported()
    return await respond(
        request, state.async_engine, body, prompt_ids, params, CompletionFormat, state.model_name
    )


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(request: Request, state: State):
    body = await _parse(request, ChatRequest, state)
    params = body.sampling_params(body.max_completion_tokens or body.max_tokens)
    messages = body.conversation()
    try:
        prompt_ids = state.engine.apply_chat_template(messages)
    except Exception as e:  # template errors (e.g. roles out of order) are the client's
        raise OpenAIError(400, f"cannot apply the chat template: {e}", "messages") from None
    return await respond(
        request, state.async_engine, body, prompt_ids, params, ChatFormat, state.model_name
    )


@router.get("/v1/models", response_model=ModelList)
async def models(state: State):
    card = ModelCard(
        id=state.model_name,
        max_model_len=state.engine.max_seq_len,
        vocab_size=state.engine.manifest.model.vocab_size,
        special_token_ids=sorted(state.engine.tokenizer.all_special_ids),
    )
    return ModelList(data=[card])


@router.get("/health", response_model=Health)
async def health(state: State):
    if state.async_engine.error is not None:
        failure = HealthFailure(error=str(state.async_engine.error))
        return JSONResponse(failure.model_dump(), status_code=503)
    stats = state.engine.stats()
    return Health(model=state.model_name, running=stats.num_running, waiting=stats.num_waiting)


@router.get("/metrics")
async def metrics(state: State):
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    return await _openai_error(request, validation_error(exc))


class RequireApiKey:
    """401 unless the request carries ``Authorization: Bearer <key>`` (compared in constant
    time); /health and /metrics stay open for probes and scrapers. A plain ASGI middleware, so
    that a route still sees its client disconnect."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            request = Request(scope)
            given = request.headers.get("authorization", "")
            if request.url.path not in PUBLIC_PATHS and not secrets.compare_digest(
                given.encode(), self.expected
            ):
                err = OpenAIError(
                    401,
                    "invalid API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
                response = await _openai_error(request, err)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


@asynccontextmanager
async def _lifespan(app: FastAPI):
    state: ServerState = app.state.trtc
    state.async_engine.start()
    stats = state.engine.stats()
    phases = dict(state.engine.startup.seconds)
    ready = seconds_since_process_start()
    if ready is not None:
        phases["ready"] = ready
    state.metrics.observe_startup(phases)
    log.info(
        "serving %s (%s executor, %d KV blocks of %d tokens)%s",
        state.model_name,
        stats.executor,
        stats.kv_blocks_total,
        stats.block_size,
        f", ready {ready:.2f} s after the process started" if ready is not None else "",
    )
    yield
    state.async_engine.stop()
    state.engine.close()


def create_app(
    engine: LLMEngine | EngineProcess, api_key: str | None = None, max_pending: int = 256
) -> FastAPI:
    """The app over `engine` (an `EngineProcess` that is ready, or an `LLMEngine` stepped on a
    thread here): at most `max_pending` requests admitted or waiting (429 beyond); with
    `api_key`, every route but /health and /metrics asks for it."""
    own_process = isinstance(engine, EngineProcess)
    engine_metrics = EngineMetrics(engine_pid=engine.pid if own_process else None)
    app = FastAPI(title="trtc", lifespan=_lifespan)
    app.state.trtc = ServerState(
        engine, AsyncEngine(engine, max_pending, engine_metrics), engine_metrics, api_key
    )
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)
    app.include_router(router)
    return app


def serve(
    engine: LLMEngine | EngineProcess,
    host: str,
    port: int,
    api_key: str | None,
    max_pending: int,
    drain_timeout: float = 60.0,
) -> None:
    """Serve until SIGTERM/SIGINT; in-flight requests get `drain_timeout` seconds to finish.
    Raise `EngineProcessError` if the engine's process died (the server stops then)."""
    import uvicorn

    app = create_app(engine, api_key, max_pending)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=drain_timeout
    )
    server = uvicorn.Server(config)
    process = engine if isinstance(engine, EngineProcess) else None
    if process is not None:  # an engine process that dies stops the server
        process.on_death = lambda: setattr(server, "should_exit", True)
    server.run()
    if process is not None and process.died:
        raise EngineProcessError(f"{process.died}; the server stopped")
