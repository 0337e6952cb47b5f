"""Reading checkpoints a tensor at a time: single and sharded safetensors, what is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from trtc.compiler.checkpoint import SafetensorsCheckpoint, StateDictSource
from trtc.errors import BuildError


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(3, generator=g).half(),
        "c.weight": torch.randn(2, 2, generator=g),
    }


def test_sharded_checkpoint_reads_each_tensor_from_its_shard(tmp_path):
    tensors = _tensors()
    save_file({"a.weight": tensors["a.weight"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file(
        {k: tensors[k] for k in ("b.weight", "c.weight")},
        tmp_path / "model-00002-of-00002.safetensors",
    )
    weight_map = {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
        "c.weight": "model-00002-of-00002.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert len(ckpt.shard_files) == 2
    assert ckpt.info()["a.weight"].shape == (4, 6)
    assert ckpt.info()["a.weight"].dtype == torch.bfloat16
    assert ckpt.nbytes == 4 * 6 * 2 + 3 * 2 + 4 * 4
    for name, t in tensors.items():
        read = ckpt.read(name)
        assert read.dtype == t.dtype and torch.equal(read, t)


def test_single_file_and_state_dict_sources_agree(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    disk, memory = SafetensorsCheckpoint(tmp_path), StateDictSource(tensors)
    assert dict(disk.info()) == dict(memory.info())
    for name in tensors:
        assert torch.equal(disk.read(name), memory.read(name))
    # A read is the caller's own tensor: changing it changes nothing in the source.
    memory.read("c.weight").zero_()
    assert torch.equal(memory.read("c.weight"), tensors["c.weight"])


def test_what_cannot_be_read_is_refused_with_the_reason(tmp_path):
    with pytest.raises(BuildError, match="no model.safetensors or model.safetensors.index.json"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "model-00001-of-00001.safetensors"}})
    )
    with pytest.raises(BuildError, match="lists shard model-00001-of-00001.safetensors"):
        SafetensorsCheckpoint(tmp_path)
    save_file({"b.weight": torch.zeros(2)}, tmp_path / "model-00001-of-00001.safetensors")
    with pytest.raises(BuildError, match="listed but not in their shard, e.g. a.weight"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(BuildError, match="not a readable safetensors file"):
        SafetensorsCheckpoint(tmp_path)
