"""`trtc build` / `trtc inspect` as a user runs them: exit codes, one-line errors, nothing left
on disk after a failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TRTC = [sys.executable, "-m", "trtc"]


def run(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [*TRTC, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env
    )


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


TINY = "model: {source: tiny, name: tiny-llama}\nprecision: fp32\n"


def bad_gpt2_checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "gpt2"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    return ckpt


@pytest.mark.parametrize(
    "case,config,expect",
    [
        (
            "unknown key",
            TINY + "kv_cache: {block_size: 16, blocksize: 8}\n",
            "kv_cache.blocksize: unknown key (allowed: block_size, dtype)",
        ),
        (
            "wrong type",
            TINY + "limits: {max_num_seqs: many}\n",
            "limits.max_num_seqs: Input should be a valid integer",
        ),
        (
            "block size",
            TINY + "kv_cache: {block_size: 24}\n",
            "kv_cache.block_size: 24 is not a power of two",
        ),
        (
            "precision",
            "model: {source: tiny, name: tiny-llama}\nprecision: fp64\n",
            "precision: Input should be 'fp16', 'bf16' or 'fp32' (got 'fp64')",
        ),
        (
            "missing model file",
            "model: {source: gguf, path: /nonexistent/model.gguf}\n",
            "model.path: GGUF file '/nonexistent/model.gguf' does not exist",
        ),
        ("not yaml", "model: [unclosed\n", "not valid YAML at line"),
        (
            "fp8 on ampere",
            TINY + "quantization: {method: fp8}\nbackend: {name: tensorrt-rtx, targets: [sm86]}\n",
            "sm86 (ampere) cannot run fp8",
        ),
    ],
)
def test_bad_config_fails_with_one_line(tmp_path, case, config, expect):
    out = tmp_path / "out"
    r = run("build", str(write_config(tmp_path, config)), "--output", str(out))
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and expect in lines[0], lines[0]
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "config.yaml"]


def test_missing_config_file(tmp_path):
    r = run("build", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "config file" in r.stderr and "does not exist" in r.stderr


def test_unsupported_architecture_lists_supported(tmp_path):
    ckpt = bad_gpt2_checkpoint(tmp_path)
    out = tmp_path / "out"
    r = run(
        "build",
        str(write_config(tmp_path, f"model: {{source: hf, path: {ckpt}}}\n")),
        "-o",
        str(out),
    )
    assert r.returncode == 1
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1
    assert "unsupported architecture 'GPT2LMHeadModel'" in err[0]
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in err[0]
    assert not out.exists()


def test_unwritable_output(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = blocker / "artifact"
    r = run("build", str(write_config(tmp_path, TINY)), "--output", str(out))
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: output: cannot write to"), r.stderr
    assert blocker.read_text() == "not a directory"


def test_existing_output_needs_force(tmp_path):
    cfg = write_config(tmp_path, TINY)
    out = tmp_path / "art"
    assert run("build", str(cfg), "-o", str(out), "-q").returncode == 0
    first = (out / "manifest.json").read_text()
    r = run("build", str(cfg), "-o", str(out))
    assert r.returncode == 2 and "already exists (use --force" in r.stderr
    assert (out / "manifest.json").read_text() == first
    assert run("build", str(cfg), "-o", str(out), "--force", "-q").returncode == 0
    assert json.loads((out / "manifest.json").read_text())["name"] == "tiny-llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "config.yaml"]


def test_interrupt_leaves_nothing(tmp_path):
    """Ctrl-C in the middle of a build: no artifact and no staging directory remain."""
    out = tmp_path / "art"
    # A shell without job control starts background jobs with SIGINT ignored, and the child
    # would inherit that: give it the default disposition, as an interactive terminal does.
    proc = subprocess.Popen(
        [*TRTC, "build", str(write_config(tmp_path, TINY)), "-o", str(out)],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    for line in proc.stderr:
        if "export" in line:  # the export stage has started
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, rest
    assert "nothing was written" in rest
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_help_explains_commands():
    r = run("--help")
    assert r.returncode == 0 and "build" in r.stdout and "inspect" in r.stdout
    r = run("build", "--help")
    assert "--output" in r.stdout and "--force" in r.stdout and "manifest.json" in r.stdout


def test_inspect_shows_what_is_inside(tiny_artifacts):
    r = run("inspect", str(tiny_artifacts["tiny-qwen2"]))
    assert r.returncode == 0, r.stderr
    text = r.stdout
    for fact in (
        "Qwen2ForCausalLM",
        "2 layers",
        "fp32",
        "trtc::PagedAttention",
        "rmsnorm",
        "rotary",
        "swiglu",
        "bytes/token",
        "weights",
        "paged, block 16 tokens",
    ):
        assert fact in text, fact
    assert "1,024 bytes/token" in text  # 2 (K,V) x 2 layers x 4 KV heads x 16 dims x 4 bytes
    assert "tuned for: none" in text
    as_json = json.loads(run("inspect", "--json", str(tiny_artifacts["tiny-qwen2"])).stdout)
    assert as_json["model"]["architecture"] == "Qwen2ForCausalLM"


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal on a machine with no GPU"
)
def test_tune_without_a_gpu_says_where_to_run_it(tiny_artifacts, tmp_path):
    r = run("tune", str(tiny_artifacts["tiny-llama"]))
    assert r.returncode == 1
    assert "run it on a machine with that GPU" in r.stderr
    r = run("build", str(write_config(tmp_path, TINY)), "-o", str(tmp_path / "out"), "--tune")
    assert r.returncode == 1 and "trtc tune ARTIFACT" in r.stderr
    assert not (tmp_path / "out").exists()  # refused before building


def test_inspect_refuses_tampered_artifact(tiny_artifacts, tmp_path):
    import shutil

    art = tmp_path / "copy"
    shutil.copytree(tiny_artifacts["tiny-llama"], art)
    with open(art / "model.onnx.data", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    r = run("inspect", str(art))
    assert r.returncode == 1 and "model.onnx.data does not match its recorded sha256" in r.stderr
    r = run("inspect", str(tmp_path))
    assert r.returncode == 1 and "is not a trtc artifact" in r.stderr


def test_tensorrt_backend_without_tensorrt_says_how_to_install(tmp_path):
    pytest.importorskip("tensorrt_rtx")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("full TensorRT is installed here")
    except ImportError:
        pass
    out = tmp_path / "out"
    cfg = write_config(tmp_path, TINY + "backend: {name: tensorrt, targets: [sm90]}\n")
    r = run("build", str(cfg), "-o", str(out))
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1 and "pip install tensorrt-cu12" in lines[0] and "tensorrt-rtx" in lines[0]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_rtx_build_records_engines_and_inspect_lists_them(tmp_path):
    pytest.importorskip("tensorrt_rtx")
    out = tmp_path / "art"
    cfg = write_config(
        tmp_path,
        "model: {source: tiny, name: tiny-qwen2}\nprecision: fp16\n"
        "limits: {max_num_tokens: 64, max_num_seqs: 4, max_seq_len: 128}\n"
        "backend: {name: tensorrt-rtx, targets: [sm86, sm89]}\n",
    )
    r = run("build", str(cfg), "-o", str(out))
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert [e["target"] for e in m["engines"]] == ["sm86", "sm89"]
    for e in m["engines"]:
        assert (out / e["file"]).is_file() and m["files"][e["file"]]["sha256"] == e["sha256"]
    text = run("inspect", str(out)).stdout
    assert "sm86 (cc 8.6)" in text and "sm89 (cc 8.9)" in text and "tensorrt-rtx" in text
    import torch

    if not torch.cuda.is_available():
        assert text.count("no: this host has no GPU") == 2


def test_rtx_refuses_hopper_target_before_work(tmp_path):
    pytest.importorskip("tensorrt_rtx")
    out = tmp_path / "out"
    r = run(
        "build",
        str(write_config(tmp_path, TINY + "backend: {name: tensorrt-rtx, targets: [sm90]}\n")),
        "-o",
        str(out),
    )
    assert r.returncode == 2 and "sm90" in r.stderr and "it supports" in r.stderr
    assert not out.exists()


def test_bench_text_option_checks_its_arguments(tiny_artifacts, tmp_path):
    art = str(tiny_artifacts["tiny-llama"])
    r = run("bench", art, "--url", "http://127.0.0.1:9", "-n", "2")
    assert r.returncode == 2 and "both only with --text" in r.stderr
    r = run("bench", art, "-n", "2", "--text", str(tmp_path / "missing.txt"), "--mode", "inflight")
    assert r.returncode == 1 and "neither 'pydoc'" in r.stderr
    r = run("bench", art, "-n", "2", "--text", "pydoc", "--mode", "inflight", "--executor", "torch")
    assert r.returncode == 0, r.stderr
    assert "(text: pydoc)" in r.stdout
