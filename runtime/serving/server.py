"""`trtc serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine.

Endpoints: /v1/completions, /v1/chat/completions (both with SSE streaming), /v1/models,
/health, /metrics. Errors are OpenAI-style JSON bodies with 4xx codes; a full server answers 429;
a client that disconnects has its request aborted and its KV blocks freed; SIGTERM stops
accepting new connections and lets in-flight requests finish (uvicorn's graceful shutdown)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from trtc.runtime.engine import LLMEngine, RequestError, RequestOutput
from trtc.runtime.engine.async_engine import AsyncEngine, QueueFull
from trtc.runtime.serving.metrics import EngineMetrics
from trtc.runtime.serving.protocol import ChatRequest, CompletionRequest, OpenAIError

log = logging.getLogger("trtc.server")
PUBLIC_PATHS = {"/health", "/metrics"}


def _error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _validation_error(e: ValidationError | RequestValidationError) -> OpenAIError:
    first = e.errors()[0]
    # Union members show up in the location ('prompt.str', 'prompt.list[int]'): keep field names only.
    type_tags = {
        "str",
        "int",
        "float",
        "bool",
        "dict",
        "list",
        "none",
        "function-after",
        "function-plain",
    }
    loc = [
        str(p)
        for p in first["loc"]
        if p != "body" and not (isinstance(p, str) and ("[" in p or p.lower() in type_tags))
    ]
    param = ".".join(loc) or None
    if first["type"] == "json_invalid":
        return OpenAIError(400, f"the request body is not valid JSON: {first['msg']}")
    if first["type"] == "missing":
        return OpenAIError(400, f"missing required parameter: '{param}'", param)
    return OpenAIError(
        400, f"invalid value for '{param}': {first['msg']} (got {first.get('input')!r})", param
    )


def create_app(engine: LLMEngine, api_key: str | None = None, max_pending: int = 256) -> FastAPI:
    engine_metrics = EngineMetrics()
    core = AsyncEngine(engine, max_pending, engine_metrics)
    model_name = engine.model_name

    @asynccontextmanager
    async def lifespan(app):
        core.start()
        stats = engine.stats()
        log.info(
            "serving %s (%s executor, %d KV blocks of %d tokens)",
            model_name,
            engine.executor.name,
            stats.kv_blocks_total,
            stats.block_size,
        )
        yield
        core.stop()

    app = FastAPI(title="trtc", lifespan=lifespan)
    app.state.core = core

    @app.exception_handler(OpenAIError)
    async def _openai_error(request, exc: OpenAIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _error_response(_validation_error(exc))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path not in PUBLIC_PATHS:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error_response(
                    OpenAIError(
                        401,
                        "invalid API key: send 'Authorization: Bearer <key>'",
                        code="invalid_api_key",
                    )
                )
        return await call_next(request)

    async def parse(request: Request, model_cls):
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        try:
            body = model_cls.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None
        if body.model != model_name:
            raise OpenAIError(
                404,
                f"the model '{body.model}' does not exist; this server serves '{model_name}'",
                "model",
                code="model_not_found",
            )
        return body

    def start(prompt_ids: list[int], params):
        try:
            core.check(prompt_ids, params)
        except RequestError as e:
            raise OpenAIError(
                400, str(e), "max_tokens" if "max_tokens" in str(e) else None
            ) from None
        if core.error is not None:
            raise OpenAIError(500, f"the engine failed: {core.error}", type="server_error")
        try:
            return core.generate(prompt_ids, params)
        except QueueFull as e:
            raise OpenAIError(429, str(e), type="rate_limit_error") from None

    async def first_output(stream):
        """Await the first output so 4xx/429 errors surface before a 200 is sent."""
        try:
            return await stream.__anext__()
        except QueueFull as e:
            raise OpenAIError(429, str(e), type="rate_limit_error") from None
        except RequestError as e:
            raise OpenAIError(400, str(e)) from None

    async def collect(request: Request, stream, first: RequestOutput) -> RequestOutput:
        """Run a non-streamed request to the end, aborting it if the client goes away."""
        last = first

        async def consume():
            nonlocal last
            async for out in stream:
                last = out

        if not first.finished:
            task = asyncio.ensure_future(consume())
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if not done and await request.is_disconnected():
                    task.cancel()
                    await stream.aclose()
                    raise asyncio.CancelledError
            task.result()
        return last

    def usage(out: RequestOutput) -> dict:
        p, c = len(out.prompt_token_ids), len(out.token_ids)
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
        }

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def streamed(
        request: Request,
        stream,
        first: RequestOutput,
        make_chunk,
        include_usage: bool,
        head: list[dict] = (),
    ):
        async def events():
            out = first
            try:
                for chunk in head:
                    yield sse(chunk)
                yield sse(make_chunk(out))
                while not out.finished:
                    out = await stream.__anext__()
                    yield sse(make_chunk(out))
                if include_usage:
                    yield sse(make_chunk(None) | {"choices": [], "usage": usage(out)})
                yield "data: [DONE]\n\n"
            finally:
                await stream.aclose()  # aborts the request if it is still running

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def respond(request: Request, body, prompt_ids: list[int], params, chat: bool):
        """Run one request and answer in the OpenAI shape of its endpoint, streamed or not."""
        stream = start(prompt_ids, params)
        first = await first_output(stream)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{first.request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }

        def choice(out: RequestOutput, whole: bool) -> dict:
            text = out.text if whole else out.delta_text
            reason = out.finish_reason if out.finished else None
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            content = (
                ("message", {"role": "assistant", "content": text})
                if whole
                else ("delta", {"content": text} if text else {})
            )
            return {"index": 0, content[0]: content[1], "logprobs": None, "finish_reason": reason}

        if body.stream:
            opening = (
                [
                    head
                    | {
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    }
                ]
                if chat
                else []
            )
            return await streamed(
                request,
                stream,
                first,
                lambda out: head if out is None else head | {"choices": [choice(out, False)]},
                bool((body.stream_options or {}).get("include_usage")),
                opening,
            )
        out = await collect(request, stream, first)
        return head | {
            "object": "chat.completion" if chat else "text_completion",
            "choices": [choice(out, True)],
            "usage": usage(out),
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await parse(request, CompletionRequest)
        params = body.sampling_params(body.max_tokens)
        prompts = body.prompt
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)):
            if len(prompts) != 1:
                raise OpenAIError(
                    400, "send one prompt per request (batched prompts are not supported)", "prompt"
                )
            prompts = prompts[0]
        if isinstance(prompts, str):
            prompt_ids = engine.tokenize(prompts)
        else:
            prompt_ids = list(prompts)
        if not prompt_ids:
            raise OpenAIError(400, "the prompt is empty", "prompt")
        if body.echo or body.suffix:
            raise OpenAIError(
                400, "echo and suffix are not supported", "echo" if body.echo else "suffix"
            )
        return await respond(request, body, prompt_ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatRequest = await parse(request, ChatRequest)
        params = body.sampling_params(body.max_completion_tokens or body.max_tokens)
        messages = [
            {"role": m.role if m.role != "developer" else "system", "content": m.text()}
            for m in body.messages
        ]
        try:
            prompt_ids = engine.apply_chat_template(messages)
        except Exception as e:  # template errors (e.g. roles out of order) are the client's
            raise OpenAIError(400, f"cannot apply the chat template: {e}", "messages") from None
        return await respond(request, body, prompt_ids, params, chat=True)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "trtc",
                    "max_model_len": engine.max_seq_len,
                    "vocab_size": engine.manifest.model.vocab_size,
                }
            ],
        }

    @app.get("/health")
    async def health():
        if core.error is not None:
            return JSONResponse({"status": "error", "error": str(core.error)}, status_code=503)
        stats = engine.stats()
        return {
            "status": "ok",
            "model": model_name,
            "running": stats.num_running,
            "waiting": stats.num_waiting,
        }

    @app.get("/metrics")
    async def metrics():
        return Response(engine_metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def serve(
    engine: LLMEngine,
    host: str,
    port: int,
    api_key: str | None,
    max_pending: int,
    drain_timeout: float = 60.0,
) -> None:
    import uvicorn

    app = create_app(engine, api_key, max_pending)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=drain_timeout
    )
    uvicorn.Server(config).run()
