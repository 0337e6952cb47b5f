"""An `LLMEngine` in a process of its own, and the server-side handle on it.

A Python server that steps the engine on a thread shares one interpreter lock between the
steps and the HTTP handlers: at tens of thousands of streamed tokens a second, each side waits
for the other and the GPU idles (measured: half the in-process throughput, the server process
at exactly one core). `EngineProcess` starts the engine in a child process (its own interpreter
and lock) and talks to it over a socket pair: commands (`AddRequest`, `AbortRequest`, `Stop`)
go down, one `StepReport` a step comes up, its outputs sent as deltas (new tokens and text)
that this side accumulates, so a message does not grow with the sequences' lengths.

This side reads the artifact's manifest and loads its own tokenizer (the front end encodes
prompts and applies chat templates); it never imports torch. It also turns tokens into text
(as vLLM's front end does): the engine process, the one at a core under load, sends the ids
of a request and nothing else, unless the request has stop strings (then the engine, which
must stop it at one, detokenizes it and sends the text). The child ignores SIGINT and
SIGTERM (a Ctrl-C, or a service manager's stop, reaches the whole process group; the server
drains and stops it in order) and exits when this side goes away. A child that dies is
reported as a failed step (every open request ends), then the server stops with exit status 1:
a replica without its engine serves nothing, and its supervisor (torchrun, systemd,
Kubernetes) restarts it at once."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from trtc.artifact import Artifact
from trtc.errors import TrtcError
from trtc.runtime.engine.config import EngineConfig
from trtc.runtime.engine.engine_loop import AddRequest, Command, StepReport, Stop, run_engine_loop
from trtc.runtime.engine.output_processor import IncrementalDetokenizer, stream_backend
from trtc.runtime.engine.outputs import EngineStats, RequestOutput
from trtc.runtime.engine.process_exit import exit_reason
from trtc.runtime.engine.request_limits import RequestLimits
from trtc.runtime.engine.startup import StartupPhases, seconds_since_process_start
from trtc.runtime.engine.tokenizer import (
    chat_prompt_ids,
    load_detokenizer,
    load_tokenizer,
    prompt_ids_of,
)

log = logging.getLogger("trtc.server")
STOP_TIMEOUT_S = 30  # a stopping engine that takes longer is killed
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class EngineProcessError(TrtcError):
    """The engine process could not start (the message is its error, or how it ended)."""


@dataclass
class EngineInfo:
    """What the child reports once its engine is up."""

    limits: RequestLimits
    stats: EngineStats
    startup: StartupPhases


# An output on the wire: (request_id, new_token_ids, delta_text, finished, finish_reason,
# num_cached_tokens, arrival_time, first_token_time, finish_time, final), where ``final`` is
# None until the request finishes, then its (token_ids, text): the final text is the engine's
# when it detokenizes the request (a matched stop string is cut from it, after deltas may have
# sent its first characters), else empty (this side makes it).
WireOutput = tuple


def _to_wire(out: RequestOutput) -> WireOutput:
    return (
        out.request_id, out.new_token_ids, out.delta_text, out.finished, out.finish_reason,
        out.num_cached_tokens, out.arrival_time, out.first_token_time, out.finish_time,
        (out.token_ids, out.text) if out.finished else None,
    )  # fmt: skip


# The engine process's first line: this process's import path, so that it imports the trtc
# this process imported. (``python -c`` puts the working directory first on the path: from a
# source checkout's root, with trtc installed as a regular package, the child would import the
# checkout's ``trtc/``, which holds the core alone.)
CHILD_CODE = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
    "from trtc.runtime.engine.engine_process import main; main()"
)


class EngineProcess:
    """The engine in a child process, with what the server asks of an engine: its name,
    limits, tokenizer, stats and start-up phases, and `start`/`submit`/`stop` for the async
    engine. Construction starts the child and returns at once; `wait_ready` waits for its
    engine (loading the tokenizer meanwhile)."""

    def __init__(self, artifact: str | Path, config: EngineConfig):
        self.artifact = Artifact.open(artifact)
        self.manifest = self.artifact.manifest
        self.model_name = self.manifest.name
        self.max_seq_len = self.manifest.limits.max_seq_len
        self.startup = StartupPhases()
        before = seconds_since_process_start()
        if before is not None:
            self.startup.record("server start", before, "up to starting the engine process")
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", CHILD_CODE, str(theirs.fileno()), json.dumps(sys.path)],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((str(self.artifact.path), config))
        self._send_lock = threading.Lock()
        self._requests: dict[str, _OpenRequest] = {}
        # The reader thread's own decode-only tokenizer: the routes encode with `tokenizer` on
        # the event loop's thread, and a Rust tokenizer is not shared across threads here.
        self._detokenizer = self._stream_backend = None
        self._stopping = False
        self._reader: threading.Thread | None = None
        self.tokenizer = None
        self.limits: RequestLimits | None = None
        self._stats: EngineStats | None = None
        self.died: str | None = None  # how the process ended, when it ended unasked
        self.on_death: Callable[[], None] | None = None  # called (reader thread) after that
        atexit.register(self._kill)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait_ready(self) -> None:
        """Load the tokenizer, then wait for the engine; raise `EngineProcessError` if it
        failed or ended before it was up."""
        self.tokenizer = load_tokenizer(self.artifact.tokenizer_dir)
        self._detokenizer = load_detokenizer(self.artifact.tokenizer_dir)
        self._stream_backend = stream_backend(self._detokenizer)
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait()
            raise EngineProcessError(
                f"the engine process ended while starting ({exit_reason(code)}); its log "
                "above says why"
            ) from None
        if kind == "failed":
            self._proc.wait()
            raise EngineProcessError(payload)
        info: EngineInfo = payload
        self.limits, self._stats = info.limits, info.stats
        self.startup.update(info.startup)

    # --- what the server reads ------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return prompt_ids_of(self.tokenizer, prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def stats(self) -> EngineStats:
        """The engine's state as of its last report."""
        return self._stats

    # --- what the async engine drives -----------------------------------------------------
    def start(self, on_report: Callable[[StepReport], None]) -> None:
        self._reader = threading.Thread(
            target=self._read, args=(on_report,), name="trtc-engine-reader", daemon=True
        )
        self._reader.start()

    def submit(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            detokenizer = None
            if command.params.detokenize and not command.params.stop:
                detokenizer = IncrementalDetokenizer(self._detokenizer, self._stream_backend)
                params = dataclasses.replace(command.params, detokenize=False)
                command = dataclasses.replace(command, params=params)
            self._requests[command.request_id] = _OpenRequest(command.prompt_ids, detokenizer)
        try:
            with self._send_lock:
                self._conn.send(command)
        except OSError:  # the child is gone: the reader reports it and fails every stream
            pass

    def stop(self) -> None:
        """Stop the engine process (its loop ends after the step it is in), or kill it after
        `STOP_TIMEOUT_S`."""
        if self._stopping:
            return
        self._stopping = True
        self.submit(Stop())
        try:
            self._proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop in %d s; killing it", STOP_TIMEOUT_S)
            self._kill()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._conn.close()
        atexit.unregister(self._kill)

    close = stop

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _read(self, on_report: Callable[[StepReport], None]) -> None:
        while True:
            try:
                report: StepReport = self._conn.recv()
            except (EOFError, OSError):
                break
            report.outputs = [self._rebuild(wire) for wire in report.outputs]
            self._stats = report.stats
            on_report(report)
        if not self._stopping:
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            self.died = f"the engine process ended ({exit_reason(code)}); its log says why"
            log.error("%s", self.died)
            on_report(StepReport([], self._stats, error=self.died))  # ends every stream
            if self.on_death is not None:
                self.on_death()

    def _rebuild(self, wire: WireOutput) -> RequestOutput:
        """The full output from its delta: prompt, tokens and text so far are kept here, and
        the text made here when the engine sends ids only (as the engine's `OutputProcessor`
        makes it: streamed, then the whole output decoded at the end)."""
        request_id, new, delta, finished, reason, cached, arrival, first, finish, final = wire
        req = self._requests.get(request_id) or _OpenRequest([])
        if final is not None:
            self._requests.pop(request_id, None)
            token_ids, text = final
        else:
            req.token_ids.extend(new)
            token_ids = list(req.token_ids)
        if req.detokenizer is not None:
            if final is None or reason == "abort":
                req.detokenizer.update(token_ids)
            else:
                req.detokenizer.finish(token_ids)
            text = req.detokenizer.text
            delta = text[len(req.text) :]
        elif final is None:
            text = req.text + delta
        req.text = text
        return RequestOutput(
            request_id, req.prompt_ids, token_ids, text, new, delta, finished, reason, cached,
            arrival, first, finish,
        )  # fmt: skip


@dataclass
class _OpenRequest:
    """A request the engine runs, as this side keeps it to rebuild its outputs from deltas:
    its detokenizer when this side makes its text (None: the engine sends it)."""

    prompt_ids: list[int]
    detokenizer: IncrementalDetokenizer | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # what was handed out so far


class _ServerGone(Exception):
    """The server's end of the socket closed: the engine process ends."""


def main() -> None:
    """The engine process: ``python -c CHILD_CODE FD PATH`` with FD its end of the socket
    pair and PATH the server's import path (JSON)."""
    fd = int(sys.argv[1])
    os.set_inheritable(fd, False)  # a subprocess of the engine must not hold the server's link
    conn = Connection(fd)
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: the server drains
    # its requests and then stops this process in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    artifact, config = conn.recv()
    config = dataclasses.replace(config, decode_only_tokenizer=True)  # the server encodes
    try:
        from trtc.runtime.engine.llm_engine import LLMEngine

        engine = LLMEngine(artifact, config)
    except BaseException as e:
        if not isinstance(e, (TrtcError, ValueError)):
            log.exception("the engine could not start")
        with contextlib.suppress(OSError):  # (the server may be gone already)
            conn.send(("failed", str(e) or type(e).__name__))
        sys.exit(1)
    info = EngineInfo(engine.limits, engine.stats(), engine.startup)
    # What start-up left (torch, the graph, kernels: about 200k objects even for a tiny model)
    # lives as long as the process: out of the collector's sight, a full collection in the step
    # loop costs microseconds instead of tens of milliseconds (vLLM's engine core does the same).
    gc.collect()
    gc.freeze()
    try:
        conn.send(("ready", info))
    except OSError:  # the server went away while the engine was loading
        engine.close()
        os._exit(0)

    def next_commands(idle: bool) -> list[Command]:
        commands: list[Command] = []
        try:
            if idle:
                conn.poll(None)  # wait for work (or for the server to go away)
            while conn.poll():
                commands.append(conn.recv())
        except (EOFError, OSError):
            commands.append(Stop())
        return commands

    def emit(report: StepReport) -> None:
        report.outputs = [_to_wire(out) for out in report.outputs]
        try:
            conn.send(report)
        except OSError:
            raise _ServerGone from None

    code = 0
    try:
        run_engine_loop(engine, next_commands, emit)
    except _ServerGone:
        pass
    except BaseException:
        log.exception("the engine loop failed")
        code = 1
    finally:
        engine.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no waiting on the executor's helper threads at interpreter exit
