"""Tensor-parallel serving over real torch.distributed process groups (gloo on CPU): the same
logits and greedy tokens as the one-rank artifact, in-process and through `trtc serve` with
the official openai client; torchrun's launch honoured; a dead worker or a signal ends every
process, never a hang."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from harness.serving import PLAIN_PROMPTS, ServerProcess, free_port
from trtc.contract import SequenceWork, make_step
from trtc.errors import ArtifactError
from trtc.runtime.engine import LLM, EngineConfig, LLMEngine, SamplingParams

MODELS = ["tiny-llama", "tiny-mistral", "tiny-qwen2"]  # GQA; sliding window + MQA; q/k/v bias
IN_PROCESS = [*MODELS, "tiny-qwen3"]  # and per-head q/k norms
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _mixed_step():
    """Two prefills (one resuming after a cached chunk) and a decode token, in one step."""
    return make_step(
        [
            SequenceWork(list(range(10, 40)), 0, [0, 1]),
            SequenceWork([7, 8, 9], 16, [2, 3]),
            SequenceWork([33], 5, [4]),
        ],
        16,
    )


@pytest.mark.parametrize("name", IN_PROCESS)
def test_two_ranks_give_the_one_rank_logits_and_tokens(tiny_artifacts, tp_artifacts, name):
    one = LLM(tiny_artifacts[name], executor="torch", num_blocks=64)
    two = LLM(tp_artifacts[name], executor="torch", num_blocks=64)
    try:
        assert two.engine.executor.world_size == 2
        step = _mixed_step()
        torch.testing.assert_close(
            two.engine.executor.execute(step), one.engine.executor.execute(step), rtol=0, atol=1e-3
        )
        prompts = [list(range(3, 3 + n)) for n in (5, 23, 40)]
        expect = [o.token_ids for o in one.generate(prompts, GREEDY)]
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == expect
    finally:
        two.engine.close()


def _worker_pids(server: ServerProcess, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.findall(r"rank \d+ pid (\d+)", server.log())
        if found:
            return [int(p) for p in found]
        time.sleep(0.2)
    raise AssertionError(f"no worker pid in the log:\n{server.log()}")


def _gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        status = Path(f"/proc/{pid}/status").read_text(errors="replace")
        if "State:\tZ" in status:  # exited, not yet reaped
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("name", MODELS)
def test_served_over_two_gloo_ranks_with_the_openai_client(
    tiny_artifacts, tp_artifacts, tmp_path, name
):
    from openai import OpenAI

    prompts = PLAIN_PROMPTS
    expect = [o.text for o in LLM(tiny_artifacts[name], executor="torch").generate(prompts, GREEDY)]
    server = ServerProcess(
        tp_artifacts[name], tmp_path / "server.log", "--executor", "torch", "--max-num-seqs", "4"
    )
    try:
        assert "tensor parallel: 2 ranks over gloo" in server.log()
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        def complete(prompt: str) -> str:
            r = client.completions.create(
                model=client.models.list().data[0].id,
                prompt=prompt,
                max_tokens=GREEDY.max_tokens,
                temperature=0,
            )
            return r.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:  # more requests than sequences a step
            got = list(pool.map(complete, prompts))
        assert got == expect
    finally:
        # uvicorn re-raises the signal after its graceful shutdown: "killed" by SIGTERM
        assert server.stop() in (0, -signal.SIGTERM), server.log()


def test_a_killed_worker_stops_the_server_with_its_reason(tp_artifacts, tmp_path):
    server = ServerProcess(
        tp_artifacts["tiny-llama"], tmp_path / "server.log", "--executor", "torch"
    )
    try:
        (pid,) = _worker_pids(server)
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        code = server.proc.wait(timeout=20)
        assert time.monotonic() - started < 10
        assert code == 1
        assert f"worker rank 1 (pid {pid}) died (killed by SIGKILL)" in server.log()
    finally:
        server.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_and_every_worker(tp_artifacts, tmp_path, sig):
    server = ServerProcess(
        tp_artifacts["tiny-llama"], tmp_path / "server.log", "--executor", "torch"
    )
    (pid,) = _worker_pids(server)
    # uvicorn re-raises the signal once shut down: SIGTERM kills, SIGINT exits 130
    assert server.stop(sig, timeout=30) in (0, -sig, 128 + sig), server.log()
    assert _gone(pid), f"worker {pid} outlived the server"
    assert "died" not in server.log()


def test_a_worker_exits_when_its_driver_is_killed(tp_artifacts, tmp_path):
    server = ServerProcess(
        tp_artifacts["tiny-llama"], tmp_path / "server.log", "--executor", "torch"
    )
    (pid,) = _worker_pids(server)
    server.stop(signal.SIGKILL)
    assert _gone(pid), f"worker {pid} outlived its killed driver"


def _generate(*launcher: str, artifact: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*launcher, "-m", "trtc", "generate", str(artifact), "The quick brown fox", "-n", "10"]
        + ["--executor", "torch"],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_torchrun_starts_the_ranks(tiny_artifacts, tp_artifacts):
    expect = _generate(sys.executable, artifact=tiny_artifacts["tiny-llama"])
    assert expect.returncode == 0, expect.stderr
    launched = _generate(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        artifact=tp_artifacts["tiny-llama"],
    )
    # Rank 1 ran rank 0's steps and printed nothing (had rank 0 spawned a worker of its own,
    # torchrun's rank 1 would wait for a group that never forms), rank 0 the same text.
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == expect.stdout


@pytest.mark.gpu
def test_more_ranks_than_gpus_is_refused_before_loading(tp_artifacts):
    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has the GPUs a two-rank artifact needs")
    with pytest.raises(ArtifactError, match="visible GPU"):
        LLMEngine(tp_artifacts["tiny-llama"], EngineConfig(executor="cuda"))


def _biased_llama(path: Path) -> Path:
    """A Llama with o_proj and down_proj biases (added once, after the sum over ranks) and an
    intermediate size whose halves are whole INT4 groups of 32, as an HF safetensors directory
    (each rank reads slices of its tensors)."""
    from transformers import LlamaForCausalLM

    from trtc.compiler.tiny import byte_tokenizer, tiny_config

    config = tiny_config("tiny-llama")
    config.intermediate_size, config.attention_bias, config.mlp_bias = 256, True, True
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # transformers initialises biases to zero
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("method", ["none", "rtn"])
def test_biases_and_int4_shards_give_the_one_rank_logits(tmp_path, method):
    from conftest import build_quiet
    from trtc.compiler.config import parse_config

    checkpoint = _biased_llama(tmp_path / "ckpt")
    built = {}
    for ranks in (1, 2):
        cfg = {
            "model": {"source": "hf", "path": str(checkpoint)},
            "precision": "fp32",
            "parallel": {"tensor": ranks},
            "quantization": {"method": method, "group_size": 32},
        }
        built[ranks] = build_quiet(parse_config(cfg), tmp_path / f"tp{ranks}")
    one = LLM(built[1], executor="torch", num_blocks=32)
    two = LLM(built[2], executor="torch", num_blocks=32)
    try:
        step = _mixed_step()
        torch.testing.assert_close(
            two.engine.executor.execute(step), one.engine.executor.execute(step), rtol=0, atol=1e-3
        )
    finally:
        two.engine.close()


def test_a_checkpoint_that_disagrees_with_its_config_is_refused_per_rank(tmp_path):
    from safetensors.torch import load_file, save_file

    from conftest import build_quiet
    from trtc.compiler.config import parse_config
    from trtc.errors import BuildError

    checkpoint = _biased_llama(tmp_path / "ckpt")
    tensors = load_file(checkpoint / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name]])  # twice the KV heads config says
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    cfg = {"model": {"source": "hf", "path": str(checkpoint)}, "parallel": {"tensor": 2}}
    with pytest.raises(BuildError, match=rf"{name} has shape \[64, 64\], the config implies \[32"):
        build_quiet(parse_config(cfg), tmp_path / "out")
