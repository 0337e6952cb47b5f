"""How `headline.py` runs its steps: every command in a process group of its own, killed with its
children past its time limit (and on exit), its output in the run's log; the steps recorded in
the results file as they end (`headline_results.ResultsFile`); the artifacts the measurements
need prepared once, on first use (`headline_artifacts.py`).

Each measurement runs its command in a fresh process rather than in this one: the GPU's memory,
a patched function (`speculative.py --force-accept`) and a hang all end with it, and a time
limit can stop it. The children start in the work folder, not the repository's root, so that
``python3 -m trtc`` imports the installed package, not the root's ``trtc/`` folder."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from headline_results import ResultsFile, utc_now

MIN_STEP_S = 30  # a step that would get less of the budget than this is skipped
KILL_GRACE_S = 15  # SIGTERM, then SIGKILL this much later


class StepTimeout(Exception):
    """A command ran past its time limit and was killed."""


def shown(argv: list) -> str:
    """A command as a shell line, this interpreter shown as ``python3``."""
    return shlex.join(["python3" if a == sys.executable else str(a) for a in argv])


def log_tail(path: Path, since: int = 0, lines: int = 3) -> str:
    """The last ``lines`` lines a command wrote to ``path`` from byte ``since`` on (the steps'
    headers left out), on one line: an entry's error."""
    try:
        with open(path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    kept = [line.strip() for line in text if line.strip() and not line.startswith("==== ")]
    return " / ".join(kept[-lines:])


class Runner:
    """Runs the steps' commands within the run's budget (``deadline``, `time.monotonic`) and
    kills every one still running on exit (`kill_all`; SIGTERM makes this process exit)."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self._live: dict[subprocess.Popen, bool] = {}  # process -> leads its own group
        self._lock = threading.Lock()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, argv: list, limit: float, log: Path, env: dict | None = None) -> None:
        """``argv`` in a process group of its own, its output appended to ``log``; an error if
        it fails, `StepTimeout` (it killed with its children) past ``limit`` seconds. The group
        stays in this session, so whatever ends the session's processes (a machine's end of
        call) ends these too, should this process be killed before it can."""
        with open(log, "a") as out:
            since = out.tell()  # where this command's output starts
            proc = subprocess.Popen(
                [str(a) for a in argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                process_group=0,  # a group of its own, in this session (see above)
            )
        self.track(proc, group=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            raise StepTimeout(f"killed after {limit:.0f} s, its time limit") from None
        except BaseException:  # this run stopped: the command with it
            self.kill(proc)
            raise
        finally:
            self.untrack(proc)
        if rc != 0:
            raise RuntimeError(f"exited with {rc}: {log_tail(log, since)}")

    def track(self, proc: subprocess.Popen, group: bool = False) -> None:
        with self._lock:
            self._live[proc] = group

    def untrack(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._live.pop(proc, None)

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGTERM to the process (its group, where it leads one), SIGKILL if it lingers."""
        group = self._live.get(proc, False)
        for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
            try:
                if group:
                    os.killpg(proc.pid, sig)
                else:
                    proc.send_signal(sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def kill_all(self) -> None:
        with self._lock:
            live = list(self._live)
        for proc in live:
            self.kill(proc)
            self.untrack(proc)


@dataclass
class Workloads:
    """The request sets the measurements replay (`trtc bench` options) and the speculative
    benchmark's run."""

    mixed: tuple[str, ...]
    single: tuple[str, ...]
    speculative: tuple[str, ...]

    def single_tokens(self) -> tuple[int, int]:
        """The single-request set's prompt and output tokens (each ``N:N``)."""
        opts = dict(zip(self.single[::2], self.single[1::2]))
        return int(opts["--prompt-len"].split(":")[0]), int(opts["--output-len"].split(":")[0])

    def concurrency(self) -> int:
        """Requests in flight in the mixed set (transformers' static batch size too)."""
        return int(dict(zip(self.mixed[::2], self.mixed[1::2]))["--concurrency"])


FULL = Workloads(  # the journal's: BENCHMARKS.md's figures come from these
    mixed=tuple("-n 256 --prompt-len 128:1024 --output-len 32:512 --concurrency 64".split()),
    single=tuple("-n 4 --prompt-len 256:256 --output-len 256:256 --concurrency 1".split()),
    speculative=tuple("--prompt-tokens 128 --max-tokens 256".split()),
)
SMOKE = Workloads(  # `--smoke`: seconds on a CPU with a tiny model
    mixed=tuple("-n 8 --prompt-len 16:64 --output-len 8:16 --concurrency 4".split()),
    single=tuple("-n 2 --prompt-len 16:16 --output-len 16:16 --concurrency 1".split()),
    speculative=tuple("--prompt-tokens 16 --max-tokens 16".split()),
)


@dataclass
class Options:
    out: Path  # the results file
    log: Path  # every command's output
    server_log: Path  # `trtc serve`'s output
    work: Path  # artifacts, checkpoints, the commands' JSON files
    given: dict[str, Path]  # artifacts given on the command line, by key
    workloads: Workloads


class Headline:
    """One run: its results file, runner, card and options, the steps recorded as they end,
    and the artifacts prepared so far (by key; None where preparing one failed)."""

    def __init__(self, results: ResultsFile, runner: Runner, card: str, options: Options):
        self.results, self.runner, self.card, self.options = results, runner, card, options
        self.built: dict[str, Path | None] = {}  # as built or given, before tuning
        self.artifacts: dict[str, Path | None] = {}  # ready to measure
        self._log_lock = threading.Lock()

    def file(self, name: str) -> Path:
        """A path in the work folder for a command's JSON output (removed first)."""
        path = self.options.work / name
        path.unlink(missing_ok=True)
        return path

    def step(
        self,
        name: str,
        command: str,
        body: Callable[[float, Path], dict],
        limit: float,
        background: bool = False,
    ) -> dict | None:
        """Run ``body(seconds, log)`` within ``limit`` seconds and what is left of the budget,
        and record the step; ``body`` returns the entry's ``figures``, ``rows`` and ``raw``.
        The figures, or None if the step did not succeed. A ``background`` step (beside
        another) logs to a file of its own, appended to the run's log when it ends."""
        entry = {"name": name, "command": command, "card": self.card}
        left = self.runner.left()
        if left < MIN_STEP_S:
            self._record(entry, "skipped", 0.0, f"out of time ({left:.0f} s left)")
            return None
        log = self.options.work / f"{name}.log" if background else self.options.log
        if background:
            log.unlink(missing_ok=True)
        else:
            self._append(f"\n==== {name}: {command}\n")
        start = time.monotonic()
        status, error = "ok", None
        try:
            entry |= body(min(limit, left), log)
        except StepTimeout as e:
            status, error = "timed out", str(e)
        except Exception as e:  # recorded; the other steps go on
            status, error = "failed", f"{type(e).__name__}: {e}"
        except BaseException:  # the run itself was stopped: say where, then stop
            self._record(entry, "timed out", time.monotonic() - start, "the run was stopped")
            raise
        finally:
            if background and log.exists():
                self._append(f"\n==== {name}: {command}\n{log.read_text(errors='replace')}")
        self._record(entry, status, time.monotonic() - start, error)
        return entry.get("figures") if status == "ok" else None

    def skip(self, name: str, command: str, error: str) -> None:
        self._record({"name": name, "command": command, "card": self.card}, "skipped", 0.0, error)

    def _record(self, entry: dict, status: str, seconds: float, error: str | None) -> None:
        entry |= {"status": status, "date": utc_now(), "seconds": round(seconds, 1)}
        if error:
            entry["error"] = error
        self.results.add(entry)
        line = f"{entry['name']}: {status} in {seconds:.0f} s"
        figures = "; ".join(f"{m} {f}" for m, f in entry.get("rows", []))
        print(line + (f": {figures}" if figures else f" ({error})" if error else ""), flush=True)

    def _append(self, text: str) -> None:
        with self._log_lock, open(self.options.log, "a") as f:
            f.write(text)
