"""The engine behind the server: asyncio handlers submit requests and await their outputs,
while the engine steps elsewhere: in a process of its own (`EngineProcess`, what `trtc serve`
runs) or on a background thread of this one (`EngineThread`, given an `LLMEngine`). Requests
are checked in the caller's thread (so errors come back at once) and handed to the engine as
commands, so a handler never waits for a step to finish. An `EngineObserver` (the server's
metrics) sees every step, output and refusal."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from trtc.runtime.core.sampling_params import SamplingParams
from trtc.runtime.engine.engine_loop import AbortRequest, AddRequest, EngineThread, StepReport
from trtc.runtime.engine.engine_process import EngineProcess
from trtc.runtime.engine.outputs import EngineStats, RequestError, RequestOutput, StepSummary

if TYPE_CHECKING:
    from trtc.runtime.engine.llm_engine import LLMEngine

log = logging.getLogger("trtc.server")


class QueueFull(Exception):
    """More requests are in flight than the server takes; the client should retry later."""


class EngineFailed(Exception):
    """The engine failed (a step raised, or its process ended); it takes no more requests."""


class EngineObserver:
    """What the engine reports (from the thread that receives its reports): the engine's
    state after each step or command, each step, each output, each refusal. Override what
    you record; the rest is ignored (the server's metrics are one)."""

    def observe_stats(self, stats: EngineStats) -> None:
        pass

    def observe_step(self, step: StepSummary) -> None:
        pass

    def observe_output(self, out: RequestOutput) -> None:
        pass

    def observe_rejected(self) -> None:
        pass


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine | EngineProcess,
        max_pending: int,
        observer: EngineObserver | None = None,
    ):
        self.engine = engine
        # An engine process is driven over its socket; an in-process engine from a thread.
        self._driver = engine if isinstance(engine, EngineProcess) else EngineThread(engine)
        self.max_pending = max_pending  # requests admitted or waiting, at most
        self.observer = observer or EngineObserver()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self.error: str | None = None

    def start(self) -> None:
        self._driver.start(self._on_report)

    def stop(self) -> None:
        self._driver.stop()

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    def _on_report(self, report: StepReport) -> None:
        """A report from the engine (on the thread that receives them): metrics, then the
        outputs to their streams; a failure ends every open stream."""
        observer = self.observer
        observer.observe_stats(report.stats)
        if report.step is not None:
            observer.observe_step(report.step)
        for out in report.outputs:
            observer.observe_output(out)
        outputs = report.outputs
        if report.error is not None:
            self.error = report.error
            ended = {out.request_id for out in outputs}
            outputs = outputs + [
                RequestOutput.aborted(request_id)
                for request_id in list(self._streams)
                if request_id not in ended
            ]
        self._deliver(outputs)

    def _deliver(self, outs: list[RequestOutput]) -> None:
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
        limits = self.engine.limits
        limits.check(prompt_ids, params)
        limits.check_fits_pool(prompt_ids, params)

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
        request_id = request_id or f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        if self.error is not None:  # after the stream is listed: a failure now ends it too
            self._streams.pop(request_id)
            raise EngineFailed(f"the engine failed: {self.error}")
        self._driver.submit(AddRequest(request_id, prompt_ids, params))
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
                self._driver.submit(AbortRequest(request_id))


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)
