"""Structure of compiled graphs: fusions, plugin nodes, I/O contract, strong typing."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from conftest import TINY_NAMES
from trtc import contract
from trtc.artifact import read_manifest
from trtc.compiler.passes.attention import check_attention
from trtc.compiler.passes.pipeline import check_report
from trtc.compiler.passes.rotary import fuse_rotary
from trtc.errors import BuildError


def op_counts(path) -> Counter:
    model = onnx.load(str(path), load_external_data=False)
    return Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph.node)


def check_structure(artifact, num_layers, norms_per_layer=2):
    """``norms_per_layer``: the two hidden-size RMSNorms, plus Qwen3's per-head q/k norms."""
    ops = op_counts(artifact / "model.onnx")
    assert ops["trtc::PagedAttention"] == num_layers
    assert ops["Softmax"] == 0
    assert ops["RMSNormalization"] == norms_per_layer * num_layers + 1
    assert ops["RotaryEmbedding"] == 2 * num_layers
    assert ops["trtc::SwiGLU"] == num_layers
    # 1 QKV + 1 gate-up + o_proj + down_proj per layer, plus the LM head.
    assert ops["Gemm"] == 4 * num_layers + 1
    for unfused in ("Pow", "ReduceMean", "Sqrt", "Reciprocal", "Sigmoid", "Sub", "Concat"):
        assert ops[unfused] == 0, f"{unfused} left in the graph"
    m = read_manifest(artifact)
    report = m.fusions
    # Stated here, not read from the pipeline's table: the test holds the pipeline to it.
    expected = dict(
        rmsnorm=norms_per_layer, rotary=2, qkv_gemm=1, gate_up_gemm=1, swiglu=1, paged_attention=1
    )
    for layer in range(num_layers):
        assert report["per_layer"][str(layer)] == expected
    assert report["expected_per_layer"] == expected
    assert report["final"] == {"rmsnorm": 1}
    return m


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_graph_structure(tiny_artifacts, name):
    check_structure(tiny_artifacts[name], 2, norms_per_layer=4 if name == "tiny-qwen3" else 2)


def test_qk_norms_fuse_per_head_before_the_rotary(tiny_artifacts):
    """Qwen3: q and k of each layer go Split -> Reshape [T, heads, D] -> RMSNormalization (the
    layer's q_norm / k_norm, weight [D]) -> Reshape [T, heads*D] -> RotaryEmbedding."""
    artifact = tiny_artifacts["tiny-qwen3"]
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    m = read_manifest(artifact)
    graph = gs.import_onnx(model)
    rotaries = [n for n in graph.nodes if n.op == "RotaryEmbedding"]
    seen = []
    for rotary in rotaries:
        unsqueeze = rotary.inputs[0].inputs[0]
        flat = unsqueeze.inputs[0].inputs[0]
        norm = flat.inputs[0].inputs[0]
        heads = norm.inputs[0].inputs[0]
        assert (unsqueeze.op, flat.op, norm.op, heads.op) == (
            "Unsqueeze",
            "Reshape",
            "RMSNormalization",
            "Reshape",
        )
        assert heads.inputs[0].inputs[0].op == "Split"
        weight = norm.inputs[1]
        assert list(weight.shape) == [m.model.head_dim]
        assert norm.attrs["epsilon"] == pytest.approx(m.model.rms_norm_eps)
        num_heads = rotary.attrs["num_heads"]
        assert list(heads.inputs[1].values) == [-1, num_heads, m.model.head_dim]
        seen.append((weight.name, num_heads))
    assert sorted(seen) == sorted(
        (f"model.layers.{i}.self_attn.{w}_norm.weight", n)
        for i in range(m.model.num_layers)
        for w, n in (("q", m.model.num_heads), ("k", m.model.num_kv_heads))
    )


def test_a_layer_missing_a_qk_norm_fusion_is_a_build_error(tiny_artifacts):
    """The report holds each layer to what the geometry expects: 4 RMSNorms a layer where the
    model has per-head q/k norms (a layer showing the 2 of other models falls short)."""
    report = read_manifest(tiny_artifacts["tiny-qwen3"]).fusions
    assert check_report(report, 2) == []
    report["per_layer"]["1"]["rmsnorm"] = 2
    assert check_report(report, 2) == ["layer 1: rmsnorm matched 2, expected 4"]
    del report["expected_per_layer"]
    assert "no expected count for rmsnorm" in check_report(report, 2)[0]


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


def rotary_spelling(y_shape) -> gs.Graph:
    """`model.apply_rotary`'s spelling over ``y`` of shape ``y_shape`` (2 heads of 8)."""
    half = 4
    y = gs.Variable("y", np.float32, y_shape)
    positions = gs.Variable("positions", np.int64, ["num_tokens"])
    nodes = []

    def ints(name, value):
        return gs.Constant(name, np.array(value, np.int64))

    def op(name, op_type, inputs, **attrs):
        out = gs.Variable(f"{name}.out", np.float32)
        nodes.append(gs.Node(op_type, name=name, inputs=inputs, outputs=[out], attrs=attrs))
        return out

    def table(name):
        rows = op(
            f"{name}.rows",
            "Gather",
            [gs.Constant(name, np.ones((16, half), np.float32)), positions],
        )
        return op(f"{name}.unsqueeze", "Unsqueeze", [rows, ints(f"{name}.axis", [1])])

    v = op("heads", "Reshape", [y, ints("heads.shape", [-1, 2, 2 * half])])
    x1 = op(
        "x1", "Slice", [v, ints("x1.start", [0]), ints("x1.end", [half]), ints("x1.axis", [-1])]
    )
    x2 = op(
        "x2",
        "Slice",
        [v, ints("x2.start", [half]), ints("x2.end", [1 << 62]), ints("x2.axis", [-1])],
    )
    cos, sin = table("rope_cos"), table("rope_sin")
    low = op("low", "Sub", [op("x1c", "Mul", [x1, cos]), op("x2s", "Mul", [x2, sin])])
    high = op("high", "Add", [op("x2c", "Mul", [x2, cos]), op("x1s", "Mul", [x1, sin])])
    rotated = op("rotated", "Concat", [low, high], axis=-1)
    out = op("flat", "Reshape", [rotated, ints("flat.shape", [-1, 4 * half])])
    return gs.Graph(nodes=nodes, inputs=[y, positions], outputs=[out])


def test_rotary_fusion_takes_a_flat_input_only():
    """The fused node reads ``[1, T, heads*D]``: a 2-D input fuses with its head count; a 3-D
    ``[T, heads, D]`` one (a per-head norm's output not reshaped back) is left as it is, not
    fused as one head of D."""
    graph = rotary_spelling(["num_tokens", 16])
    result = fuse_rotary(graph)
    graph.cleanup()
    assert result.matched == 1
    (rotary,) = [n for n in graph.nodes if n.op == "RotaryEmbedding"]
    assert rotary.attrs == {"num_heads": 2, "interleaved": 0}
    assert not [n for n in graph.nodes if n.op in ("Slice", "Concat", "Mul")]

    graph = rotary_spelling(["num_tokens", 2, 8])
    result = fuse_rotary(graph)
    assert result.matched == 0 and "input y is not [tokens, heads*8]" in result.notes[0]
    assert not [n for n in graph.nodes if n.op == "RotaryEmbedding"]


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
