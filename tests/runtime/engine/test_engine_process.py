"""The engine in a process of its own: the same tokens as in this one, a front end without
torch, a start-up failure that says why, and a process that dies ending every stream instead
of hanging it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from harness.serving import ServerProcess
from trtc.runtime.core.sampling_params import SamplingParams
from trtc.runtime.engine import LLM, EngineConfig
from trtc.runtime.engine.async_engine import AsyncEngine, EngineFailed
from trtc.runtime.engine.engine_process import EngineProcess, EngineProcessError

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47]]
CONFIG = EngineConfig(executor="torch", num_blocks=64)


async def run_all(async_engine: AsyncEngine, params: SamplingParams) -> list[list]:
    async def one(prompt):
        return [out async for out in async_engine.generate(prompt, params)]

    return await asyncio.gather(*(one(p) for p in PROMPTS))


def through_a_process(art, *param_sets: SamplingParams) -> tuple[EngineProcess, list]:
    """An engine process, `PROMPTS` streamed through it once per set of parameters, stopped:
    the process and, per set, each prompt's outputs."""
    engine = EngineProcess(art, CONFIG)
    engine.wait_ready()
    async_engine = AsyncEngine(engine, 8)
    async_engine.start()
    try:
        return engine, [asyncio.run(run_all(async_engine, p)) for p in param_sets]
    finally:
        async_engine.stop()


def test_the_engine_process_streams_what_the_engine_gives_in_process(tiny_artifacts):
    art = tiny_artifacts["tiny-llama"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = LLM(art, executor="torch", num_blocks=64).generate(PROMPTS, params)
    engine, (streams,) = through_a_process(art, params)
    assert engine._proc.returncode == 0  # stopped in order, not killed
    for outs, w in zip(streams, want):
        last = outs[-1]
        assert last.finished and last.finish_reason == "length"
        assert last.token_ids == w.token_ids and last.text == w.text
        assert [t for o in outs for t in o.new_token_ids] == w.token_ids  # deltas add up
        assert last.prompt_token_ids == w.prompt_token_ids
    stats = engine.stats()
    assert stats.num_running == 0 and stats.counters.generation_tokens == 3 * 24
    assert engine.limits.kv_blocks == 64 and "weights" in engine.startup.seconds


def test_text_made_on_the_server_side_or_with_stop_strings_by_the_engine(tiny_artifacts):
    """Without stop strings the engine process sends ids and this side makes the text; with
    them, the engine (which must stop at one) sends it: both as the engine gives in-process."""
    art = tiny_artifacts["tiny-llama"]
    plain = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ref = LLM(art, executor="torch", num_blocks=64).generate(PROMPTS, plain)
    text = next(w.text for w in ref if len(w.text) > 6)
    stop = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=(text[3:6],))
    want = LLM(art, executor="torch", num_blocks=64).generate(PROMPTS, stop)
    assert any(w.finish_reason == "stop" for w in want)
    _, (got_plain, got_stop) = through_a_process(art, plain, stop)
    for streams, expected in ((got_plain, ref), (got_stop, want)):
        for outs, w in zip(streams, expected):
            assert (outs[-1].text, outs[-1].finish_reason) == (w.text, w.finish_reason)
            assert outs[-1].token_ids == w.token_ids
            # The deltas streamed add up to the text, save what a stop string cut at the end.
            streamed = "".join(o.delta_text for o in outs)
            assert streamed.startswith(w.text)
            assert streamed == w.text or w.finish_reason == "stop"


def test_the_server_side_imports_no_torch(tiny_artifacts):
    """The front end (HTTP server, tokenizer, engine handle) leaves torch to the engine's
    process: its memory and import time are paid once, there."""
    code = (
        "import trtc.runtime.serving.server\n"
        "from trtc.runtime.engine import EngineConfig\n"
        "from trtc.runtime.engine.engine_process import EngineProcess\n"
        "e = EngineProcess(sys.argv[1], EngineConfig(executor='torch', num_blocks=16))\n"
        "e.wait_ready()\n"
        "e.stop()\n"
        "print(sorted(m for m in ('torch', 'onnx', 'triton') if m in sys.modules))\n"
    )
    assert last_line_of(code, tiny_artifacts["tiny-llama"]) == "[]"


def last_line_of(code: str, artifact) -> str:
    """The last line ``code`` prints in a fresh interpreter (``sys`` imported, the artifact's
    path in ``sys.argv[1]``)."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code, str(artifact)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_an_engine_given_prompts_as_ids_imports_no_transformers(tiny_artifacts):
    """The engine process (prompts come as ids) decodes with the Rust tokenizer alone: the
    seconds of transformers' import stay out of its start. (Its text equals the full
    tokenizer's: the first test above compares them.)"""
    code = (
        "from trtc.runtime.engine import EngineConfig, LLMEngine\n"
        "config = EngineConfig(executor='torch', num_blocks=16, decode_only_tokenizer=True)\n"
        "engine = LLMEngine(sys.argv[1], config)\n"
        "print(type(engine.tokenizer).__name__, 'transformers' in sys.modules)\n"
    )
    assert last_line_of(code, tiny_artifacts["tiny-llama"]) == "Detokenizer False"


def test_an_engine_that_cannot_start_says_why(tiny_artifacts):
    engine = EngineProcess(tiny_artifacts["tiny-llama"], EngineConfig(executor="nonsense"))
    with pytest.raises(EngineProcessError, match="nonsense"):
        engine.wait_ready()
    assert engine._proc.returncode == 1


def test_a_dead_engine_process_ends_every_stream(tiny_artifacts):
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    engine = EngineProcess(tiny_artifacts["tiny-llama"], CONFIG)
    engine.wait_ready()
    async_engine = AsyncEngine(engine, 8)
    async_engine.start()

    async def kill_after_first_tokens():
        async def one(prompt):
            outs = []
            async for out in async_engine.generate(prompt, params):
                outs.append(out)
                if len(outs) == 2 and prompt is PROMPTS[0]:
                    os.kill(engine.pid, signal.SIGKILL)
            return outs

        streams = await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS)), 60)
        with pytest.raises(EngineFailed, match="SIGKILL"):
            await anext(async_engine.generate(PROMPTS[0], params))
        return streams

    try:
        streams = asyncio.run(kill_after_first_tokens())
    finally:
        async_engine.stop()
    for outs in streams:
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert sum(len(o.new_token_ids) for o in outs) < 400  # cut short
    assert "killed by SIGKILL" in async_engine.error


def regular_install(root: Path, venv: Path) -> Path:
    """trtc installed as a regular package (not editable) into a new virtual environment that
    borrows this one's dependencies through a path (whose ``.pth`` files, this checkout's
    editable hook among them, are not run there); its ``trtc`` command."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-compile", str(root)],
        check=True,
        timeout=600,
    )
    return venv / "bin" / "trtc"


def test_serve_from_a_source_checkout_against_a_regular_install(tiny_artifacts, tmp_path):
    """Run from the repository's root, a regular install's `trtc serve` starts its engine
    process on the trtc the server imported, not on the checkout's ``trtc/`` (which the
    working directory would put first on a child's path: it holds the core alone)."""
    root = Path(__file__).resolve().parents[3]
    trtc = regular_install(root, tmp_path / "venv")
    check = "import trtc.runtime, sys; print(trtc.runtime.__file__)"
    installed = subprocess.run(
        [trtc.parent / "python", "-c", check], capture_output=True, text=True, cwd=tmp_path
    ).stdout
    assert installed.startswith(str(tmp_path / "venv")), installed
    server = ServerProcess(
        tiny_artifacts["tiny-llama"], tmp_path / "serve.log", trtc=[str(trtc)], cwd=root
    )
    try:
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "tiny-llama", "prompt": "one two three", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        # uvicorn re-raises the signal after its graceful shutdown: the status may say SIGTERM.
        assert server.stop() in (0, -signal.SIGTERM), server.log()
