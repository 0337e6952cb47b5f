"""LoRA: an adapter merged at build time gives the logits of the PEFT model with the adapter
unmerged; an adapter for another base model is refused before any weight is loaded."""

from __future__ import annotations

import pytest
import torch

from conftest import build_quiet
from trtc.artifact import Artifact
from trtc.compiler.config import parse_config
from trtc.compiler.tiny import tiny_model
from trtc.contract import SequenceWork, make_step
from trtc.errors import ConfigError
from trtc.runtime.executors.torch_executor import TorchExecutor

peft = pytest.importorskip("peft")


def make_adapter(name: str, path, seed: int = 0):
    torch.manual_seed(seed)
    base = tiny_model(name, seed=0)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        init_lora_weights=False,  # random A and B: a real change
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05)
    model.save_pretrained(str(path))
    return model.eval()


def test_merged_adapter_matches_peft_model(tmp_path):
    peft_model = make_adapter("tiny-llama", tmp_path / "adapter")
    cfg = parse_config(
        {
            "model": {"source": "tiny", "name": "tiny-llama", "lora": str(tmp_path / "adapter")},
            "precision": "fp32",
        }
    )
    art = build_quiet(cfg, tmp_path / "art")
    ex = TorchExecutor(Artifact.open(art), num_blocks=8)
    ids = list(range(3, 43))
    got = ex.execute(make_step([SequenceWork(ids, 0, [0, 1, 2])], 16))[0]
    with torch.no_grad():
        want = peft_model(torch.tensor([ids])).logits[0, -1]
        base = tiny_model("tiny-llama", seed=0)(torch.tensor([ids])).logits[0, -1]
    assert float((want - base).abs().max()) > 1e-2, "the adapter changes the model"
    assert float((got - want).abs().max()) < 1e-3
    import json

    m = json.loads((art / "manifest.json").read_text())
    assert m["source"]["lora"]["rank"] == 4 and len(m["source"]["lora"]["sha256"]) == 64


def test_adapter_for_another_base_model_is_refused(tmp_path):
    make_adapter("tiny-qwen2", tmp_path / "qwen-adapter")  # 4 KV heads: k_proj is 64 wide, not 32
    cfg = parse_config(
        {
            "model": {
                "source": "tiny",
                "name": "tiny-llama",
                "lora": str(tmp_path / "qwen-adapter"),
            },
            "precision": "fp32",
        }
    )
    with pytest.raises(
        ConfigError, match=r"model.lora: .* does not fit this model: layer 0 k_proj"
    ):
        build_quiet(cfg, tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_not_an_adapter_directory(tmp_path):
    with pytest.raises(ConfigError, match="not a PEFT adapter directory"):
        parse_config({"model": {"source": "tiny", "name": "tiny-llama", "lora": str(tmp_path)}})
