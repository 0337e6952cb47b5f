"""The loop that drives an `LLMEngine` for a server: requests and aborts come in as commands,
each step's outputs go out as one `StepReport`. The same loop runs on a thread beside the
server (`EngineThread`) or in a process of its own (`engine_process`), where the steps no longer
share an interpreter lock with the HTTP handlers."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trtc.runtime.core.sampling_params import SamplingParams
from trtc.runtime.engine.outputs import EngineStats, RequestError, RequestOutput, StepSummary

if TYPE_CHECKING:
    from trtc.runtime.engine.llm_engine import LLMEngine

log = logging.getLogger("trtc.server")

# While requests run, a piece of the start-up work left for after ready (a CUDA graph's warm-up
# or capture: a few milliseconds) goes between two steps at most this often.
BUSY_START_UP_INTERVAL_S = 1.0


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


class Stop:
    """End the loop (the engine is closed by whoever owns it)."""


Command = AddRequest | AbortRequest | Stop


@dataclass
class StepReport:
    """What the engine did since the last report: a step (``step``) or commands (None), the
    outputs it produced, its state afterwards, and ``error`` when a step failed (every request
    in the engine was aborted then)."""

    outputs: list[RequestOutput]
    stats: EngineStats
    step: StepSummary | None = None
    error: str | None = None


def run_engine_loop(
    engine: LLMEngine,
    next_commands: Callable[[bool], list[Command]],
    emit: Callable[[StepReport], None],
) -> None:
    """Apply commands and step while requests are unfinished, until a `Stop`.
    ``next_commands(idle)`` returns the commands waiting, and waits for one when ``idle``.
    The start-up work the engine left for after ready (`LLMEngine.finish_start_up`) goes a
    piece at a time: while idle, piece after piece between looks for commands; while requests
    run, one piece a `BUSY_START_UP_INTERVAL_S` between steps (under load from the start it
    must not wait for an idle moment that may not come, nor hold the first requests up)."""
    start_up_left, last_piece = True, time.monotonic()
    while True:
        outputs, commands = [], next_commands(not engine.has_unfinished() and not start_up_left)
        for command in commands:
            if isinstance(command, Stop):
                return
            if isinstance(command, AddRequest):
                try:
                    engine.add_request(None, command.params, command.request_id, command.prompt_ids)
                except Exception as e:  # that request's failure, never the engine's
                    if not isinstance(e, RequestError):
                        log.exception("request %s could not be added", command.request_id)
                    outputs.append(
                        RequestOutput(
                            command.request_id, command.prompt_ids, [], "", [], "", True,
                            f"error: {e}",
                        )
                    )  # fmt: skip
            elif (out := _abort(engine, command.request_id)) is not None:
                outputs.append(out)
        if commands:
            emit(StepReport(outputs, engine.stats()))
        if start_up_left and (
            not engine.has_unfinished() or time.monotonic() - last_piece >= BUSY_START_UP_INTERVAL_S
        ):
            try:
                start_up_left = engine.finish_start_up()
            except Exception:  # the engine still serves, without what was left
                log.exception("deferred start-up work failed; steps it would speed run eagerly")
                start_up_left = False
            last_piece = time.monotonic()
        if not engine.has_unfinished():
            continue
        try:
            outputs = engine.step()
        except BaseException as e:  # a broken executor must not hang every client
            log.exception("engine step failed")
            aborted = [_abort(engine, rid) for rid in engine.unfinished_request_ids()]
            error = f"{type(e).__name__}: {e}"
            emit(StepReport([o for o in aborted if o is not None], engine.stats(), error=error))
            continue
        emit(StepReport(outputs, engine.stats(), engine.last_step))


def _abort(engine: LLMEngine, request_id: str) -> RequestOutput | None:
    """The request aborted; if aborting it fails, an abort output all the same (its stream
    must end) and the failure in the log."""
    try:
        return engine.abort(request_id)
    except Exception:
        log.exception("request %s could not be aborted cleanly", request_id)
        return RequestOutput.aborted(request_id)


class EngineThread:
    """The loop on a thread of this process: what `AsyncEngine` drives an `LLMEngine` with
    when the engine is not in a process of its own (tests, the offline paths)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: collections.deque[Command] = collections.deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_report: Callable[[StepReport], None]) -> None:
        self._thread = threading.Thread(
            target=run_engine_loop,
            args=(self.engine, self._next_commands, on_report),
            name="trtc-engine",
            daemon=True,
        )
        self._thread.start()

    def submit(self, command: Command) -> None:
        self._commands.append(command)
        self._wake.set()

    def stop(self) -> None:
        self.submit(Stop())
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _next_commands(self, idle: bool) -> list[Command]:
        if idle and not self._commands:
            self._wake.wait(timeout=0.5)
        self._wake.clear()
        commands = []
        while self._commands:
            commands.append(self._commands.popleft())
        return commands
