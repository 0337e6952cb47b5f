"""The engine behind the server: `LLMEngine.step()` runs in one background thread; asyncio
handlers submit requests and await their outputs. Requests are checked in the caller's thread
(so errors come back at once) and handed to the engine thread through a command queue, so a
handler never waits for a step to finish. An `EngineObserver` (the server's metrics) sees every
step, output and refusal."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator

from trtc.runtime.core.sequence import SamplingParams
from trtc.runtime.engine.llm_engine import LLMEngine
from trtc.runtime.engine.outputs import EngineStats, RequestError, RequestOutput, StepSummary

log = logging.getLogger("trtc.server")


class QueueFull(Exception):
    """More requests are in flight than the server takes; the client should retry later."""


class EngineObserver:
    """What the engine thread reports (from that thread): the engine's state after each step or
    command, each step, each output, each refusal. Override what you record; the rest is
    ignored (the server's metrics are one)."""

    def observe_stats(self, stats: EngineStats) -> None:
        pass

    def observe_step(self, step: StepSummary) -> None:
        pass

    def observe_output(self, out: RequestOutput) -> None:
        pass

    def observe_rejected(self) -> None:
        pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_pending: int, observer: EngineObserver | None = None):
        self.engine = engine
        self.max_pending = max_pending  # requests admitted or waiting, at most
        self.observer = observer or EngineObserver()
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="trtc-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop:
            while self._commands:
                kind, *args = self._commands.popleft()
                if kind == "add":
                    request_id, prompt_ids, params = args
                    try:
                        engine.add_request(
                            None, params, request_id=request_id, prompt_ids=prompt_ids
                        )
                    except RequestError as e:  # checked before; only a race could get here
                        self._deliver(
                            RequestOutput(
                                request_id, prompt_ids, [], "", [], "", True, f"error: {e}"
                            )
                        )
                else:
                    out = engine.abort(args[0])
                    if out is not None:
                        self.observer.observe_output(out)
                        self._deliver(out)
                self.observer.observe_stats(engine.stats())
            if not engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except BaseException as e:  # a broken executor must not hang every client
                log.exception("engine step failed")
                self.error = e
                for request_id in list(self._streams):
                    out = engine.abort(request_id)
                    self._deliver(
                        out or RequestOutput(request_id, [], [], "", [], "", True, "abort")
                    )
                continue
            self.observer.observe_stats(engine.stats())
            if engine.last_step is not None:
                self.observer.observe_step(engine.last_step)
            for out in outputs:
                self.observer.observe_output(out)
            self._deliver(*outputs)

    def _deliver(self, *outs: RequestOutput) -> None:
        """Hand outputs to their streams: one wake-up of each event loop for a step's outputs,
        not one per output (each wakes the loop through a pipe, and a busy server steps
        thousands of outputs a second)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                loop, queue = stream
                by_loop.setdefault(loop, []).append((queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop closed under us (shutdown)
                pass

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.check_request(prompt_ids, params)
        bm = self.engine.block_manager
        need = bm.blocks_for(len(prompt_ids) + params.max_tokens)
        if need > bm.num_blocks:
            raise RequestError(
                f"prompt + max_tokens need {need} KV blocks but the server's pool "
                f"has {bm.num_blocks}; lower max_tokens or shorten the prompt"
            )

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as tokens arrive, one per step, or the outputs that
        arrived while the consumer was busy as one (`RequestOutput.then`: a slow client gets
        several tokens a chunk instead of falling further behind); abort the request if the
        consumer goes away."""
        self.check(prompt_ids, params)
        if self.num_pending >= self.max_pending:
            self.observer.observe_rejected()
            raise QueueFull(
                f"the server is at capacity ({self.max_pending} requests in flight); retry later"
            )
        request_id = request_id or self.engine.new_request_id()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._commands.append(("add", request_id, prompt_ids, params))
        self._wake.set()
        finished = False
        try:
            while True:
                out = await queue.get()
                while not out.finished and not queue.empty():  # the consumer fell behind
                    out = out.then(queue.get_nowait())
                if out.finish_reason and out.finish_reason.startswith("error: "):
                    raise RequestError(out.finish_reason.removeprefix("error: "))
                finished = out.finished
                yield out
                if finished:
                    break
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.append(("abort", request_id))
                self._wake.set()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)
