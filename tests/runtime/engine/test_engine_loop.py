"""The loop that drives an engine for a server: the start-up work an engine leaves for after
ready (a server's CUDA graphs) runs a piece at a time, while idle and, less often, between
steps (a server under load from the start must still get it done), and never stops a
request."""

from __future__ import annotations

import threading

import pytest

from trtc.runtime.core.sequence import SamplingParams
from trtc.runtime.engine import LLM, EngineConfig, LLMEngine, engine_loop
from trtc.runtime.engine.engine_loop import AddRequest, EngineThread

PROMPT = [5, 6, 7, 8, 9, 10]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


class DeferringEngine(LLMEngine):
    """A real engine whose start-up leaves ``pieces`` pieces of work for after ready (on a CPU
    there is no graph to capture): records whether a request was unfinished at each, and how
    many steps ran before it; fails at piece ``fail_at``."""

    def __init__(self, art, pieces: int, fail_at: int | None = None):
        super().__init__(art, EngineConfig(executor="torch", num_blocks=64))
        self.pieces, self.fail_at = pieces, fail_at
        self.ran: list[tuple[bool, int]] = []
        self.steps = 0
        self.started, self.release = threading.Event(), threading.Event()

    def finish_start_up(self) -> bool:
        if not self.ran:  # the first piece lasts until a request has been submitted
            self.started.set()
            self.release.wait(10)
        self.ran.append((self.has_unfinished(), self.steps))
        if len(self.ran) == self.fail_at:
            raise RuntimeError("capture failed")
        return len(self.ran) < self.pieces

    def step(self):
        self.steps += 1
        return super().step()


def serve_one(engine: DeferringEngine):
    reports, done = [], threading.Event()

    def on_report(report):
        reports.append(report)
        if any(o.finished for o in report.outputs):
            done.set()

    thread = EngineThread(engine)
    thread.start(on_report)
    assert engine.started.wait(10), "no start-up work ran while idle"
    thread.submit(AddRequest("r", PROMPT, PARAMS))
    engine.release.set()
    assert done.wait(30), "the request never finished"
    thread.stop()
    return [o for r in reports for o in r.outputs if o.finished][0]


def test_start_up_work_left_for_after_ready_waits_while_a_request_runs(tiny_artifacts):
    """While idle, piece after piece; a request that comes meanwhile waits for the piece in
    progress only, and the rest go once it is done (it takes less than the busy interval)."""
    art = tiny_artifacts["tiny-llama"]
    want = LLM(art, executor="torch", num_blocks=64).generate([PROMPT], PARAMS)[0]
    engine = DeferringEngine(art, pieces=5)
    out = serve_one(engine)
    assert out.token_ids == want.token_ids
    assert engine.ran == [(False, 0)] + [(False, 12)] * 4


@pytest.mark.parametrize("fail_at", [None, 3])
def test_start_up_work_goes_between_steps_under_load(tiny_artifacts, monkeypatch, fail_at):
    """Under load from the start (here: a busy interval of zero), the pieces go between
    steps, one at a time, and a piece that fails ends them, not the request."""
    monkeypatch.setattr(engine_loop, "BUSY_START_UP_INTERVAL_S", 0.0)
    art = tiny_artifacts["tiny-llama"]
    want = LLM(art, executor="torch", num_blocks=64).generate([PROMPT], PARAMS)[0]
    engine = DeferringEngine(art, pieces=5, fail_at=fail_at)
    out = serve_one(engine)
    assert out.token_ids == want.token_ids  # served, also when a piece failed
    if fail_at is None:
        # The first piece ran while idle; the request came during it, and the other four went
        # one a step while it ran (12 steps): the request did not wait for them all.
        assert engine.ran == [(False, 0), (True, 0), (True, 1), (True, 2), (True, 3)]
    else:  # none after the one that failed
        assert engine.ran == [(False, 0), (True, 0), (True, 1)]
