"""FP8 (E4M3) KV cache end to end on a tiny model: calibrated per-layer scales in the manifest and
on every PagedAttention node, an E4M3 pool at half the bytes of fp16, and logits close to the same
model with an fp32 cache."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from conftest import build_quiet
from trtc.artifact import Artifact
from trtc.compiler.config import parse_config
from trtc.contract import SequenceWork, make_step
from trtc.errors import ConfigError
from trtc.runtime.core.sequence import SamplingParams
from trtc.runtime.engine import LLM
from trtc.runtime.executors.torch_executor import TorchExecutor

CALIB = {"num_samples": 4, "seq_len": 64}


def config(kv_dtype: str, **extra):
    return parse_config(
        {
            "model": {"source": "tiny", "name": "tiny-llama"},
            "precision": "fp32",
            "kv_cache": {"dtype": kv_dtype},
            "limits": {"max_num_tokens": 256, "max_num_seqs": 8},
            "quantization": {"calibration": CALIB},
            **extra,
        }
    )


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    return {kv: build_quiet(config(kv), root / kv) for kv in ("fp8", "fp32")}


def test_manifest_and_graph_carry_the_scales(artifacts):
    m = json.loads((artifacts["fp8"] / "manifest.json").read_text())
    kv = m["kv_cache"]
    assert kv["dtype"] == "fp8" and kv["bytes_per_token"] == 2 * 2 * 2 * 16 * 1
    s = kv["scales"]
    assert len(s["k"]) == len(s["v"]) == 2 and all(0 < x < 1 for x in s["k"] + s["v"])
    assert s["calibration"]["num_samples"] == 4 and len(s["calibration"]["text_sha256"]) == 64
    model = onnx.load(str(artifacts["fp8"] / "model.onnx"), load_external_data=False)
    kv_inputs = [i for i in model.graph.input if i.name.startswith("kv_cache.")]
    assert kv_inputs and all(
        i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT8E4M3FN for i in kv_inputs
    )
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    for layer, node in enumerate(nodes):
        attrs = {a.name: a.f for a in node.attribute if a.name in ("k_scale", "v_scale")}
        assert attrs["k_scale"] == pytest.approx(s["k"][layer], rel=1e-6)
        assert attrs["v_scale"] == pytest.approx(s["v"][layer], rel=1e-6)
    other = onnx.load(str(artifacts["fp32"] / "model.onnx"), load_external_data=False)
    assert all(
        a.f == 1.0
        for n in other.graph.node
        if n.op_type == "PagedAttention"
        for a in n.attribute
        if a.name in ("k_scale", "v_scale")
    )


def test_logits_close_to_the_fp32_cache(artifacts):
    fp8, fp32 = (
        TorchExecutor(Artifact.open(artifacts["fp8"]), 16),
        TorchExecutor(Artifact.open(artifacts["fp32"]), 16),
    )
    assert fp8.kv_pool.dtype == torch.float8_e4m3fn
    prompt = list(range(7, 57))
    work = [SequenceWork(prompt, 0, [1, 2, 3, 4])]
    for step in range(4):
        a, b = fp8.execute(make_step(work, 16)), fp32.execute(make_step(work, 16))
        # E4M3 keeps ~3 significant bits of each cached value: close, not equal.
        assert 0 < float((a - b).abs().max()) < 0.1 * float(b.abs().max())
        token = int(b[0].argmax())  # both continue with the same token
        work = [SequenceWork([token], len(prompt) + step, [1, 2, 3, 4])]


def test_generates_through_the_engine(artifacts):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 5, list(range(30, 70))]
    outs = LLM(artifacts["fp8"], num_blocks=32).generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [12, 12]


def test_fp8_kv_with_tensorrt_rtx_is_refused():
    with pytest.raises(
        ConfigError, match="kv_cache.dtype: fp8 is not available with backend tensorrt-rtx"
    ):
        config("fp8", backend={"name": "tensorrt-rtx", "targets": ["sm89"]})
