"""Structure of compiled graphs: fusions, plugin nodes, I/O contract, strong typing."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from trtc import contract
from trtc.artifact import read_manifest
from trtc.compiler.passes.attention import check_attention
from trtc.errors import BuildError


def op_counts(path) -> Counter:
    model = onnx.load(str(path), load_external_data=False)
    return Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph.node)


def check_structure(artifact, num_layers):
    ops = op_counts(artifact / "model.onnx")
    assert ops["trtc::PagedAttention"] == num_layers
    assert ops["Softmax"] == 0
    assert ops["RMSNormalization"] == 2 * num_layers + 1
    assert ops["RotaryEmbedding"] == 2 * num_layers
    assert ops["trtc::SwiGLU"] == num_layers
    # 1 QKV + 1 gate-up + o_proj + down_proj per layer, plus the LM head.
    assert ops["Gemm"] == 4 * num_layers + 1
    for unfused in ("Pow", "ReduceMean", "Sqrt", "Reciprocal", "Sigmoid", "Sub", "Concat"):
        assert ops[unfused] == 0, f"{unfused} left in the graph"
    m = read_manifest(artifact)
    report = m.fusions
    # Stated here, not read from the pipeline's table: the test holds the pipeline to it.
    expected = dict(rmsnorm=2, rotary=2, qkv_gemm=1, gate_up_gemm=1, swiglu=1, paged_attention=1)
    for layer in range(num_layers):
        assert report["per_layer"][str(layer)] == expected
    assert report["final"] == {"rmsnorm": 1}
    return m


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen2"])
def test_tiny_graph_structure(tiny_artifacts, name):
    check_structure(tiny_artifacts[name], 2)


@pytest.mark.slow
def test_smollm2_graph_structure(smollm2_fp32):
    m = check_structure(smollm2_fp32, 30)
    assert m.model.num_layers == 30 and m.model.num_kv_heads == 3
    assert m.kv_cache.bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert m.plugins[0]["op_type"] == "PagedAttention" and m.plugins[0]["num_nodes"] == 30


def test_io_matches_contract(tiny_artifacts):
    artifact = tiny_artifacts["tiny-llama"]
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    m = read_manifest(artifact)

    def shape(v):
        return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]

    assert [(v.name, shape(v)) for v in model.graph.input] == [
        (t.name, t.shape) for t in m.io.inputs
    ]
    assert [(v.name, shape(v)) for v in model.graph.output] == [
        (t.name, t.shape) for t in m.io.outputs
    ]
    assert list(contract.STEP_INPUTS) == [t.name for t in m.io.inputs][:7]
    # Each plugin node writes its layer's cache straight to the graph output that aliases the input.
    for node in model.graph.node:
        if node.op_type == "PagedAttention":
            layer = int(node.input[3].split(".")[1])
            assert node.output[1] == contract.kv_output_name(layer)
            assert m.io.aliases[node.output[1]] == node.input[3]


def test_fp16_build_is_strongly_typed(tmp_path):
    from conftest import build_quiet
    from trtc.compiler.config import parse_config

    cfg = parse_config({"model": {"source": "tiny", "name": "tiny-qwen2"}, "precision": "fp16"})
    out = build_quiet(cfg, tmp_path / "fp16")
    model = onnx.load(str(out / "model.onnx"))
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}
    for init in model.graph.initializer:
        if init.data_type in floats and np.prod(init.dims) > 1:
            assert init.data_type == onnx.TensorProto.FLOAT16, init.name
    outputs = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    assert outputs["logits"] == onnx.TensorProto.FLOAT
    assert outputs["kv_cache_out.0"] == onnx.TensorProto.FLOAT16
    rms = [n for n in model.graph.node if n.op_type == "RMSNormalization"]
    assert all(a.i == 1 for n in rms for a in n.attribute if a.name == "stash_type")


def test_unfused_attention_is_a_build_error():
    x = gs.Variable("x", dtype=np.float32, shape=[4, 4])
    y = gs.Variable("y", dtype=np.float32, shape=[4, 4])
    graph = gs.Graph(
        nodes=[gs.Node("Softmax", name="attn.softmax", inputs=[x], outputs=[y])],
        inputs=[x],
        outputs=[y],
    )
    with pytest.raises(BuildError, match="attention not fused.*Softmax"):
        check_attention(graph, 1)
    graph = gs.Graph(nodes=[], inputs=[x], outputs=[x])
    with pytest.raises(BuildError, match=r"layer\(s\) \[0, 1\]"):
        check_attention(graph, 2)
