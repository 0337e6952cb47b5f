"""`trtc checkpoint`: random-weight Hugging Face checkpoints, written a tensor at a time, are
what transformers' save_pretrained writes (files, shards, index, bytes), load back through
safetensors and transformers with the generated values, depend only on the seed, and appear
whole or not at all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from trtc.compiler import random_checkpoint as rc
from trtc.compiler.tiny import TINY_MODELS
from trtc.errors import ConfigError

TINY = [name for name in TINY_MODELS if name.startswith("tiny-")]


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


def weight_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if "safetensors" in p.name}


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of an odd size, so every matrix is drawn and written in several."""
    monkeypatch.setattr(rc, "PIECE_ELEMENTS", 999)


@pytest.mark.parametrize("name", TINY)
def test_loads_in_transformers_with_the_generated_values(tmp_path, name, small_pieces):
    out = rc.write_random_checkpoint(name, tmp_path / "ckpt", dtype="bf16", seed=3).path
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert model.dtype == torch.bfloat16
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    stored = read_weights(out)
    shapes, _ = rc.saved_tensors(rc.checkpoint_config(name))
    assert set(stored) == set(shapes)
    for key, t in model.state_dict().items():
        source = key if key in stored else "model.embed_tokens.weight"  # a tied head
        want = rc.random_tensor(source, tuple(t.shape), "bf16", seed=3)
        assert torch.equal(stored[source], want), key
        assert torch.equal(t, want), key


@pytest.mark.parametrize("name,dtype", [*[(n, "bf16") for n in TINY], ("tiny-llama", "fp32")])
def test_same_files_as_save_pretrained(tmp_path, name, dtype, small_pieces):
    """Shards, index and config byte for byte as transformers writes them for the same weights
    (several shards, one of them a tensor larger than the shard size)."""
    shard = 30_000 if dtype == "bf16" else 60_000
    ours = rc.write_random_checkpoint(name, tmp_path / "ours", dtype, shard_bytes=shard).path
    config = rc.checkpoint_config(name)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, rc.DTYPES[dtype][0]))
    with torch.no_grad():
        for key, p in model.state_dict().items():
            tied = config.tie_word_embeddings and key == "lm_head.weight"
            source = "model.embed_tokens.weight" if tied else key
            p.copy_(rc.random_tensor(source, tuple(p.shape), dtype))
    model.save_pretrained(tmp_path / "hf", max_shard_size=shard)
    theirs = weight_files(tmp_path / "hf")
    assert len(theirs) > 3
    assert weight_files(ours) == theirs
    for name_ in ("config.json", "generation_config.json"):
        assert (ours / name_).read_text() == (tmp_path / "hf" / name_).read_text()


def test_sharding_and_index(tmp_path):
    shard = 50_000
    r = rc.write_random_checkpoint("tiny-qwen2", tmp_path / "ckpt", "fp32", shard_bytes=shard)
    index = json.loads((r.path / rc.SAFETENSORS_INDEX).read_text())
    shapes, parameters = rc.saved_tensors(rc.checkpoint_config("tiny-qwen2"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 5 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(shapes)
    assert index["metadata"] == {"total_parameters": parameters, "total_size": r.weight_bytes}
    assert r.weight_bytes == sum(4 * torch.Size(s).numel() for s in shapes.values())
    for f in files:
        with safe_open(str(r.path / f), "pt") as st:
            keys = list(st.keys())
            assert keys == sorted(k for k, v in index["weight_map"].items() if v == f)
            data = sum(torch.Size(st.get_slice(k).get_shape()).numel() * 4 for k in keys)
            assert data <= shard or len(keys) == 1
    assert not (r.path / rc.SAFETENSORS_SINGLE).exists()
    assert set(r.files) == {p.name for p in r.path.iterdir()}
    assert r.bytes == sum(p.stat().st_size for p in r.path.iterdir())


def test_one_file_when_it_fits(tmp_path):
    r = rc.write_random_checkpoint("tiny-llama", tmp_path / "ckpt", "fp16")
    assert sorted(p.name for p in r.path.glob("model*")) == [rc.SAFETENSORS_SINGLE]
    assert json.loads((r.path / "config.json").read_text())["dtype"] == "float16"
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(r.files)


def test_same_seed_same_bytes_any_sharding(tmp_path):
    a = rc.write_random_checkpoint("tiny-llama", tmp_path / "a", seed=1, shard_bytes=30_000).path
    b = rc.write_random_checkpoint("tiny-llama", tmp_path / "b", seed=1, shard_bytes=30_000).path
    c = rc.write_random_checkpoint("tiny-llama", tmp_path / "c", seed=1).path
    d = rc.write_random_checkpoint("tiny-llama", tmp_path / "d", seed=2, shard_bytes=30_000).path
    assert weight_files(a) == weight_files(b)
    assert (a / rc.SAFETENSORS_INDEX).read_bytes() == (b / rc.SAFETENSORS_INDEX).read_bytes()
    wa, wc, wd = read_weights(a), read_weights(c), read_weights(d)
    assert all(torch.equal(wa[k], wc[k]) for k in wa)  # one file or several: the same values
    matrices = [k for k in wa if wa[k].ndim == 2]
    assert not any(torch.equal(wa[k], wd[k]) for k in matrices)
    assert weight_files(a).keys() == weight_files(d).keys()
    assert weight_files(a) != weight_files(d)


def test_tied_embeddings(tmp_path):
    tied = read_weights(rc.write_random_checkpoint("tiny-mistral", tmp_path / "tied").path)
    untied = read_weights(rc.write_random_checkpoint("tiny-llama", tmp_path / "untied").path)
    assert "lm_head.weight" not in tied and "model.embed_tokens.weight" in tied
    assert "lm_head.weight" in untied


def test_values(tmp_path):
    """Norm scales are ones, matrices and biases normal with std 0.02."""
    w = read_weights(rc.write_random_checkpoint("tiny-qwen2", tmp_path / "ckpt", "fp32").path)
    norms = [k for k in w if "norm" in k]
    biases = [k for k in w if k.endswith(".bias")]
    assert norms and biases
    assert all(torch.equal(w[k], torch.ones_like(w[k])) for k in norms)
    matrices = torch.cat([w[k].flatten() for k in w if w[k].ndim == 2])
    assert abs(matrices.std().item() - 0.02) < 0.0005 and abs(matrices.mean().item()) < 0.0005
    assert all(w[k].std() > 0.01 for k in biases)


def test_llama_3_8b_geometry():
    """Meta-Llama-3-8B's tensors: 8.03B parameters, 16,060,522,496 bytes in bf16 (as published),
    four 5 GB shards."""
    config = rc.checkpoint_config("llama-3-8b")
    shapes, parameters = rc.saved_tensors(config)
    assert parameters == 8_030_261_248 and len(shapes) == 291
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["lm_head.weight"] == (128256, 4096)
    sizes = {k: 2 * torch.Size(s).numel() for k, s in shapes.items()}
    assert sum(sizes.values()) == 16_060_522_496
    assert len(rc.plan_shards(sizes, rc.DEFAULT_SHARD_BYTES)) == 4
    assert config.rope_parameters["rope_theta"] == 500000.0


def test_names():
    assert rc.checkpoint_names() == [*TINY_MODELS, "llama-3-8b"]
    with pytest.raises(ConfigError, match="unknown geometry 'llama-9b'.*known: tiny-llama"):
        rc.checkpoint_config("llama-9b")
    with pytest.raises(ConfigError, match="dtype 'fp64' is not one of bf16, fp16, fp32"):
        rc.write_random_checkpoint("tiny-llama", "/nonexistent/x", dtype="fp64")


@pytest.mark.parametrize(
    "text,value",
    [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), ("1.5kb", 1500), ("77", 77)],
)
def test_parse_size(text, value):
    assert rc.parse_size(text) == value


@pytest.mark.parametrize("text", ["5XB", "", "-1GB", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        rc.parse_size(text)


@pytest.mark.parametrize("error", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_failure_leaves_nothing(tmp_path, error):
    def fail_after_first(shard):
        raise error

    out = tmp_path / "new" / "dirs" / "ckpt"
    with pytest.raises(type(error)):
        rc.write_random_checkpoint("tiny-llama", out, shard_bytes=30_000, progress=fail_after_first)
    assert list(tmp_path.iterdir()) == []


def test_not_enough_space(tmp_path, monkeypatch):
    usage = rc.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(rc.shutil, "disk_usage", lambda p: usage._replace(free=10**5))
    with pytest.raises(ConfigError, match="needs 0.5 MB and .* has 0.1 MB free; free some"):
        rc.write_random_checkpoint("tiny-llama", tmp_path / "ckpt", "fp32")
    assert list(tmp_path.iterdir()) == []


def test_existing_output(tmp_path):
    out = rc.write_random_checkpoint("tiny-llama", tmp_path / "ckpt", seed=0).path
    before = weight_files(out)
    with pytest.raises(ConfigError, match="already exists.*--force"):
        rc.write_random_checkpoint("tiny-llama", out, seed=1)
    assert weight_files(out) == before
    rc.write_random_checkpoint("tiny-llama", out, seed=1, force=True)
    assert weight_files(out) != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging left over

    other = tmp_path / "not-a-checkpoint"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        rc.write_random_checkpoint("tiny-llama", other, force=True)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def trtc(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "trtc", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli(tmp_path):
    out = tmp_path / "ckpt"
    r = trtc("checkpoint", "tiny-llama", "--output", str(out), "--shard-size", "100KB")
    assert r.returncode == 0, r.stderr
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1
    for s in shards:
        assert f"{s}: " in r.stderr
    summary = r.stderr.strip().splitlines()[-1]
    assert summary.startswith(f"checkpoint: {out}") and f"{len(os.listdir(out))} files" in summary
    with_api = rc.write_random_checkpoint("tiny-llama", tmp_path / "api", shard_bytes=100_000)
    assert weight_files(out) == weight_files(with_api.path)

    again = trtc("checkpoint", "tiny-llama", "--output", str(out))
    assert again.returncode == 2 and "already exists (use --force" in again.stderr


def test_cli_unknown_name(tmp_path):
    r = trtc("checkpoint", "llama-9b", "--output", str(tmp_path / "ckpt"))
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: checkpoint: unknown geometry 'llama-9b'")
    assert "llama-3-8b" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_cli_terminated_mid_write_leaves_nothing(tmp_path):
    """SIGTERM between shards of the 1.1B geometry: exit 130, no checkpoint, no staging."""
    out = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trtc", "checkpoint", "llama-1b-random", "-o", str(out)]
        + ["--shard-size", "100MB"],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:
        if "(1/" in line:  # the first shard is written, the next one is being written
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, rest
    assert "nothing was written" in rest
    assert list(tmp_path.iterdir()) == []
