"""Runs one HTTP request on the async engine, for the routes.

`start` submits the request and waits for its first output, so that refusals (bad request 400,
server at capacity 429, engine failed 500) are raised as `OpenAIError` before a 200 is sent.
`respond` then either collects the request to its end or streams it as server-sent events. A
client that goes away has its request aborted, which frees its KV blocks at once instead of
when the generation would have ended."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from trtc.runtime.core.sampling_params import SamplingParams
from trtc.runtime.engine.async_engine import AsyncEngine, EngineFailed, QueueFull
from trtc.runtime.engine.outputs import RequestError, RequestOutput
from trtc.runtime.serving.protocol import OpenAIError, ResponseFormat, SamplingFields

OutputStream = AsyncGenerator[RequestOutput, None]

# How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went away


async def start(
    async_engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams
) -> tuple[OutputStream, RequestOutput]:
    """The request's output stream and its first output."""
    try:
        async_engine.check(prompt_ids, params)
    except RequestError as e:
        raise OpenAIError(400, str(e), "max_tokens" if "max_tokens" in str(e) else None) from None
    if async_engine.error is not None:
        raise OpenAIError(500, f"the engine failed: {async_engine.error}", type="server_error")
    stream = async_engine.generate(prompt_ids, params)
    try:
        return stream, await stream.__anext__()
    except QueueFull as e:
        raise OpenAIError(429, str(e), type="rate_limit_error") from None
    except EngineFailed as e:
        raise OpenAIError(500, str(e), type="server_error") from None
    except RequestError as e:
        raise OpenAIError(400, str(e)) from None


async def _last_output(stream: OutputStream, last: RequestOutput) -> RequestOutput:
    async for out in stream:
        last = out
    return last


async def collect(
    request: Request, stream: OutputStream, first: RequestOutput
) -> RequestOutput | None:
    """The request's final output, or None (and the request aborted) if the client disconnects
    first."""
    if first.finished:
        return first
    task = asyncio.ensure_future(_last_output(stream, first))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                return None
        return task.result()
    finally:
        task.cancel()  # nothing once done; else the stream's cleanup aborts the request


def sse(message: BaseModel | str) -> str:
    """One server-sent event; a model is sent as its JSON."""
    data = message if isinstance(message, str) else message.model_dump_json()  # pydantic-core
    return f"data: {data}\n\n"


async def _events(
    stream: OutputStream, first: RequestOutput, fmt: ResponseFormat, include_usage: bool
):
    out = first
    try:
        for chunk in fmt.opening():
            yield sse(chunk)
        yield sse(fmt.chunk_json(out))
        while not out.finished:
            out = await stream.__anext__()
            yield sse(fmt.chunk_json(out))
        if include_usage:
            yield sse(fmt.usage_chunk(out))
        yield sse("[DONE]")
    finally:
        await stream.aclose()  # aborts the request if it is still running


def event_stream(
    stream: OutputStream, first: RequestOutput, fmt: ResponseFormat, include_usage: bool
) -> StreamingResponse:
    """The request as server-sent events: a chunk per output, then ``data: [DONE]``."""
    return StreamingResponse(
        _events(stream, first, fmt, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def respond(
    request: Request,
    async_engine: AsyncEngine,
    body: SamplingFields,
    prompt_ids: list[int],
    params: SamplingParams,
    format_cls: type[ResponseFormat],
    model: str,
) -> BaseModel | Response:
    """Run one request and answer in its endpoint's shape, streamed or whole."""
    stream, first = await start(async_engine, prompt_ids, params)
    fmt = format_cls(first.request_id, model, body.return_token_ids)
    if body.stream:
        return event_stream(stream, first, fmt, body.include_usage)
    last = await collect(request, stream, first)
    if last is None:  # the client is gone and reads nothing
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return fmt.response(last)
