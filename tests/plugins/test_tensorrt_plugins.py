"""The full-TensorRT backend on a machine without TensorRT or a GPU: the IPluginV3 plugins built
from real ``tensorrt_rtx`` classes (same Python plugin API as full TensorRT), their shape and type
rules against the reference ops, the graph preparation and profile of the engine build, and the
build failing cleanly where full TensorRT is absent."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from harness.optional_trt import needs_trt, trt
from trtc.artifact import Artifact
from trtc.errors import BuildError, ConfigError
from trtc.plugins import PLUGINS
from trtc.plugins.spec import DOMAIN
from trtc.plugins.tensorrt import rules
from trtc.plugins.tensorrt.plugin import (
    create_plugin,
    deregister_plugins,
    plugin_classes,
    register_plugins,
    run_plugin,
)

ATTRS = {  # valid attributes per plugin, some at float32-exact values, some not
    "PagedAttention": dict(
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        scale=16**-0.5,
        sliding_window=24,
        k_scale=0.37,
        v_scale=1.0,
    ),
    "Int4Gemm": dict(group_size=32, in_features=64, out_features=48),
    "Fp8Gemm": dict(in_features=64, out_features=40),
    "AllReduce": dict(world_size=2),
}


def fields(attrs: dict, spec) -> trt.PluginFieldCollection:
    return trt.PluginFieldCollection(
        [
            trt.PluginField(n, d, getattr(trt.PluginFieldType, k))
            for n, d, k in rules.field_values(spec, attrs)
        ]
    )


def as_float32(attrs: dict) -> dict:
    return {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in attrs.items()}


# --- fields ----------------------------------------------------------------------------------


@needs_trt
@pytest.mark.parametrize("op", list(PLUGINS))
def test_creator_advertises_the_spec(op):
    spec = PLUGINS[op]
    _, creator_cls = plugin_classes(trt)
    creator = creator_cls(spec)
    assert (creator.name, creator.plugin_version, creator.plugin_namespace) == (
        op,
        str(spec.version),
        DOMAIN,
    )
    advertised = [(f.name, f.type) for f in creator.field_names]
    assert advertised == [
        (n, getattr(trt.PluginFieldType, rules.FIELD_TYPES[t][0]))
        for n, t in spec.attributes.items()
    ]


@needs_trt
@pytest.mark.parametrize("op", list(PLUGINS))
def test_fields_round_trip_through_creator_plugin_and_clone(op):
    spec = PLUGINS[op]
    _, creator_cls = plugin_classes(trt)
    creator = creator_cls(spec)
    plugin = creator.create_plugin("layer0", fields(ATTRS[op], spec), trt.TensorRTPhase.BUILD)
    assert plugin.attrs == as_float32(ATTRS[op])  # ONNX float attributes are float32 too
    assert (plugin.plugin_name, plugin.plugin_version, plugin.plugin_namespace) == (
        op,
        str(spec.version),
        DOMAIN,
    )
    assert plugin.num_outputs == len(spec.outputs)

    again = creator.create_plugin(
        "layer0", plugin.get_fields_to_serialize(), trt.TensorRTPhase.RUNTIME
    )
    assert again.attrs == plugin.attrs and again.phase == trt.TensorRTPhase.RUNTIME
    clone = again.clone()
    assert clone is not again and clone.attrs == again.attrs and clone.phase == again.phase
    assert clone.get_capability_interface(trt.PluginCapabilityType.RUNTIME) is clone
    assert again.attach_to_context(None).attrs == again.attrs


@needs_trt
@pytest.mark.parametrize(
    "op,change,message",
    [
        ("PagedAttention", {"drop": "num_heads"}, "field num_heads is missing"),
        (
            "PagedAttention",
            {"retype": ("num_heads", "FLOAT32")},
            "field num_heads is FLOAT32, expected INT32",
        ),
        ("PagedAttention", {"extra": "window"}, r"unknown field\(s\) window"),
        (
            "PagedAttention",
            {"set": {"num_kv_heads": 3}},
            "num_heads 8 is not a multiple of num_kv_heads 3",
        ),
        (
            "PagedAttention",
            {"set": {"sliding_window": -1}},
            "sliding_window is -1, expected a non-negative",
        ),
        ("PagedAttention", {"set": {"head_dim": 0}}, "head_dim is 0, expected a positive"),
        ("Int4Gemm", {"set": {"in_features": 63}}, "in_features 63 is odd"),
        ("Fp8Gemm", {"drop": "out_features"}, "trtc::Fp8Gemm: field out_features is missing"),
    ],
)
def test_bad_fields_are_clear_errors(op, change, message):
    spec = PLUGINS[op]
    attrs = {**ATTRS[op], **change.get("set", {})}
    items = [(n, d, k) for n, d, k in rules.field_values(spec, attrs) if n != change.get("drop")]
    if "retype" in change:
        name, kind = change["retype"]
        items = [
            (n, d.astype(np.float32) if n == name else d, kind if n == name else k)
            for n, d, k in items
        ]
    if "extra" in change:
        items.append((change["extra"], np.array([4], np.int32), "INT32"))
    fc = trt.PluginFieldCollection(
        [trt.PluginField(n, d, getattr(trt.PluginFieldType, k)) for n, d, k in items]
    )
    _, creator_cls = plugin_classes(trt)
    with pytest.raises(rules.PluginFieldError, match=message):
        creator_cls(spec).create_plugin("layer0", fc, trt.TensorRTPhase.BUILD)


def test_fields_the_entry_point_defaults_are_optional():
    # A node exported before k_scale/v_scale existed still makes a plugin (the entry point's
    # defaults).
    spec = PLUGINS["PagedAttention"]
    old = {k: v for k, v in ATTRS["PagedAttention"].items() if k not in ("k_scale", "v_scale")}
    attrs = rules.parse_fields(spec, rules.fields_from_attributes(spec, old))
    assert attrs["k_scale"] == attrs["v_scale"] == 1.0
    assert rules.num_required_inputs(spec) == len(spec.inputs)
    assert rules.num_required_inputs(PLUGINS["Int4Gemm"]) == PLUGINS["Int4Gemm"].inputs.index(
        "bias"
    )


# --- shapes and types against the reference ops ---------------------------------------------


def paged_attention_inputs(dtype, kv_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, block_size, num_blocks = 8, 2, 16, 4, 12
    lens, new = [5, 9, 1], [5, 2, 1]  # a prefill, a prefill chunk, a decode
    tables = torch.tensor([[0, 1, 0], [2, 3, 4], [5, 0, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 5, 7, 8], dtype=torch.int32)
    t = sum(new)
    slots = []
    for s, (length, n) in enumerate(zip(lens, new)):
        slots += [
            int(tables[s, p // block_size]) * block_size + p % block_size
            for p in range(length - n, length)
        ]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    return [
        torch.randn(t, heads * head_dim, generator=g).to(dtype),
        torch.randn(t, kv_heads * head_dim, generator=g).to(dtype),
        torch.randn(t, kv_heads * head_dim, generator=g).to(dtype),
        (cache * 0.1).to(kv_dtype),
        torch.tensor(slots, dtype=torch.int64),
        tables,
        torch.tensor(lens, dtype=torch.int32),
        qsl,
    ]


def gemm_inputs(op, dtype, lead, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, n = ATTRS[op]["in_features"], ATTRS[op]["out_features"]
    x = torch.randn(*lead, k, generator=g).to(dtype)
    if op == "Int4Gemm":
        groups = -(-k // ATTRS[op]["group_size"])
        ins = [
            x,
            torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
            (torch.rand(n, groups, generator=g) * 0.02).to(dtype),
            torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8),
        ]
    else:
        ins = [
            x,
            (torch.randn(n, k, generator=g) * 0.1).to(torch.float8_e4m3fn),
            torch.rand(n, generator=g) + 0.5,
            torch.tensor(0.05),
        ]
    return ins + ([torch.randn(n, generator=g).to(dtype)] if bias else [])


CASES = (
    [
        ("PagedAttention", paged_attention_inputs(d, d))
        for d in (torch.float32, torch.float16, torch.bfloat16)
    ]
    + [("PagedAttention", paged_attention_inputs(torch.float16, torch.float8_e4m3fn))]
    + [
        (op, gemm_inputs(op, d, lead, bias))
        for op in ("Int4Gemm", "Fp8Gemm")
        for d in (torch.float32, torch.float16, torch.bfloat16)
        for lead, bias in (((7,), True), ((2, 3), False))
    ]
)


@pytest.mark.parametrize("op,inputs", CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(CASES)])
def test_shape_and_type_rules_are_the_reference_ops(op, inputs):
    spec = PLUGINS[op]
    attrs = dict(ATTRS[op])
    if op == "PagedAttention" and inputs[3].dtype != torch.float8_e4m3fn:
        attrs["k_scale"] = 1.0  # scales apply to an FP8 cache only
    outputs = rules.entry_point(spec)(*[t.clone() for t in inputs], **attrs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert [list(o.shape) for o in outputs] == rules.output_shapes(
        spec, attrs, [t.shape for t in inputs]
    )
    assert [o.dtype for o in outputs] == rules.output_dtypes(spec, [t.dtype for t in inputs])
    # TensorRT's format question at every position, with the dtypes TensorRT would carry.
    names = [rules.trt_side(rules.DTYPE_NAMES[t.dtype]) for t in [*inputs, *outputs]]
    assert all(rules.supports(spec, pos, len(inputs), names) for pos in range(len(names)))
    for pos in range(len(inputs)):  # the op reads each input back in its own dtype
        assert rules.op_side(spec, pos, names[pos]) == rules.DTYPE_NAMES[inputs[pos].dtype]


@pytest.mark.parametrize(
    "op,pos,dtype",
    [
        ("PagedAttention", 5, "int64"),  # block_tables are int32
        ("PagedAttention", 1, "fp32"),  # key must share query's fp16
        ("PagedAttention", 8, "fp32"),  # attn_out is query's dtype
        ("Int4Gemm", 1, "uint8"),  # TensorRT plugins take no uint8: it travels as int8
        ("Fp8Gemm", 3, "fp16"),  # input_scale is fp32
    ],
)
def test_supports_refuses_other_dtypes(op, pos, dtype):
    spec = PLUGINS[op]
    good = {
        "PagedAttention": [
            "fp16",
            "fp16",
            "fp16",
            "fp16",
            "int64",
            "int32",
            "int32",
            "int32",
            "fp16",
            "fp16",
        ],
        "Int4Gemm": ["fp16", "int8", "fp16", "int8", "fp16", "fp16"],
        "Fp8Gemm": ["fp16", "fp8", "fp32", "fp32", "fp16"],
    }[op]
    n_in = len(good) - len(spec.outputs)
    assert all(rules.supports(spec, p, n_in, good) for p in range(len(good)))
    bad = list(good)
    bad[pos] = dtype
    assert not rules.supports(spec, pos, n_in, bad)


def test_shape_rule_builds_expressions_from_dimensions_and_constants():
    # get_output_shapes hands the rule TensorRT IDimensionExprs and IExprBuilder.constant; an
    # IExprBuilder only works inside a builder (constructed alone, using it crashes), so the same
    # rule runs here on symbols: every output dimension is an input dimension or a constant.
    spec = PLUGINS["Int4Gemm"]
    shapes = [[("x", 0), ("x", 1)], [("w", 0), ("w", 1)], [], []]
    out = rules.output_shapes(spec, ATTRS["Int4Gemm"], shapes, constant=lambda v: ("const", v))
    assert out == [[("x", 0), ("const", 48)]]
    spec = PLUGINS["PagedAttention"]
    shapes = [[(name, i) for i in range(2)] for name in spec.inputs]
    assert rules.output_shapes(spec, ATTRS["PagedAttention"], shapes) == [shapes[0], shapes[3]]


# --- the plugin objects with real TensorRT-RTX classes --------------------------------------


def descs(dtypes, fmt=None):
    out = []
    for d in dtypes:
        t = trt.PluginTensorDesc()
        t.type = {
            "fp16": trt.float16,
            "fp32": trt.float32,
            "int8": trt.int8,
            "uint8": trt.uint8,
            "int32": trt.int32,
            "int64": trt.int64,
            "fp8": trt.fp8,
        }[d]
        t.format = fmt or trt.TensorFormat.LINEAR
        dyn = trt.DynamicPluginTensorDesc()
        dyn.desc = t
        out.append(dyn)
    return out


@needs_trt
def test_plugin_answers_tensorrt_with_its_own_types():
    pa = create_plugin(trt, "PagedAttention", ATTRS["PagedAttention"], trt.TensorRTPhase.BUILD)
    types = [trt.float16] * 3 + [trt.fp8, trt.int64, trt.int32, trt.int32, trt.int32]
    assert pa.get_output_data_types(types) == [trt.float16, trt.fp8]
    assert [pa.get_aliased_input(i) for i in range(2)] == [
        -1,
        PLUGINS["PagedAttention"].inputs.index("kv_cache"),
    ]

    gemm = create_plugin(trt, "Int4Gemm", ATTRS["Int4Gemm"], trt.TensorRTPhase.BUILD)
    assert gemm.get_aliased_input(0) == -1
    for with_bias in (False, True):
        io = descs(["fp16", "int8", "fp16", "int8"] + ["fp16"] * with_bias + ["fp16"])
        n_in = 4 + with_bias
        assert all(gemm.supports_format_combination(p, io, n_in) for p in range(len(io)))
        gemm.configure_plugin(io[:n_in], io[n_in:])
    assert not gemm.supports_format_combination(1, descs(["fp16", "uint8"]), 4)
    assert not gemm.supports_format_combination(0, descs(["fp16"], trt.TensorFormat.CHW2), 4)
    with pytest.raises(ValueError, match="3 inputs"):
        gemm.configure_plugin(descs(["fp16", "int8", "fp16"]), descs(["fp16"]))


@needs_trt
def test_register_plugins_puts_creators_in_the_registry():
    registry = trt.get_plugin_registry()
    try:
        creators = register_plugins(trt)
        assert register_plugins(trt) == creators  # once per module
        for op, spec in PLUGINS.items():
            found = registry.get_creator(op, str(spec.version), DOMAIN)
            assert found is not None and found.name == op and found.plugin_namespace == DOMAIN
    finally:
        deregister_plugins(trt)  # TensorRT-RTX's parser aborts on Python plugins: leave none behind


# --- what enqueue runs, on CPU tensors ------------------------------------------------------


def test_run_plugin_fills_outputs_and_updates_the_cache_in_place():
    spec = PLUGINS["PagedAttention"]
    inputs = paged_attention_inputs(torch.float32, torch.float32)
    attrs = {**ATTRS["PagedAttention"], "k_scale": 1.0}
    expected_out, expected_cache = rules.entry_point(spec)(*[t.clone() for t in inputs], **attrs)
    cache = inputs[3]
    attn_out = torch.full_like(expected_out, float("nan"))
    run_plugin(spec, attrs, inputs, [attn_out, cache])  # kv_cache_out aliases kv_cache
    torch.testing.assert_close(attn_out, expected_out, rtol=0, atol=0)
    torch.testing.assert_close(cache, expected_cache, rtol=0, atol=0)

    separate = torch.zeros_like(cache)  # an unaliased output gets a copy
    run_plugin(
        spec, attrs, paged_attention_inputs(torch.float32, torch.float32), [attn_out, separate]
    )
    torch.testing.assert_close(separate, expected_cache, rtol=0, atol=0)

    spec = PLUGINS["Int4Gemm"]
    inputs = gemm_inputs(
        "Int4Gemm", torch.float32, (5,), bias=False
    )  # bias omitted, as in the node
    y = torch.empty(5, ATTRS["Int4Gemm"]["out_features"])
    run_plugin(spec, ATTRS["Int4Gemm"], inputs, [y])
    torch.testing.assert_close(
        y, rules.entry_point(spec)(*inputs, **ATTRS["Int4Gemm"]), rtol=0, atol=0
    )


def test_run_plugin_all_reduce_sums_over_the_group_and_adds_the_bias_once(tmp_path):
    import torch.distributed as dist

    from trtc.plugins.all_reduce import use_group

    spec = PLUGINS["AllReduce"]
    x, bias, y = torch.randn(3, 8), torch.randn(8), torch.empty(3, 8)
    with pytest.raises(RuntimeError, match="joined no tensor-parallel group"):
        run_plugin(spec, {"world_size": 1}, [x], [y])
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        use_group(dist.group.WORLD)
        run_plugin(spec, {"world_size": 1}, [x, bias], [y])  # one rank: the sum is x
        torch.testing.assert_close(y, x + bias, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="over 2 ranks, but the process group has 1"):
            run_plugin(spec, ATTRS["AllReduce"], [x], [y])
    finally:
        use_group(None)
        dist.destroy_process_group()


# --- the engine build, where it can run ---------------------------------------------------------


def test_without_tensorrt_the_build_says_how_to_install_and_leaves_nothing(tmp_path):
    try:
        import tensorrt  # noqa: F401

        pytest.skip("full TensorRT is installed here")
    except (ImportError, OSError):
        pass
    from trtc.compiler.backends.tensorrt_full import build_tensorrt_engines
    from trtc.compiler.build import build
    from trtc.compiler.config import parse_config
    from trtc.compiler.progress import Progress

    cfg = parse_config(
        {
            "model": {"source": "tiny", "name": "tiny-llama"},
            "precision": "fp32",
            "backend": {"name": "tensorrt", "targets": ["sm90"]},
        }
    )
    with pytest.raises(
        ConfigError,
        match=r"backend.name: 'tensorrt' needs full TensorRT.*"
        r"pip install tensorrt-cu12.*tensorrt-rtx",
    ):
        build(cfg, output=str(tmp_path / "out"), progress=Progress(quiet=True))
    assert list(tmp_path.iterdir()) == []  # no artifact, no .out.partial-* staging dir
    with pytest.raises(BuildError, match="pip install tensorrt-cu12"):
        build_tensorrt_engines(onnx.ModelProto(), tmp_path / "engines-out", ["sm90"], {})
    assert list(tmp_path.iterdir()) == []


def test_build_checks_refuse_a_machine_without_the_target_gpu():
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    from trtc.compiler.backends.tensorrt_full import check_targets

    with pytest.raises(ConfigError, match="no CUDA device.*tensorrt-rtx"):
        check_targets(["sm90"])
    with pytest.raises(ConfigError, match="hardware_compatibility: 'turing'"):
        check_targets(["sm90"], hardware_compatibility="turing")


def test_engine_profile_covers_every_contract_input(tiny_artifacts):
    from trtc.compiler.backends.tensorrt_full import paged_profile

    manifest = Artifact.open(tiny_artifacts["tiny-llama"]).manifest
    limits, bs = manifest.limits, manifest.kv_cache.block_size
    profile = paged_profile(manifest.io.inputs, limits, bs)
    assert list(profile) == [t.name for t in manifest.io.inputs]
    for t in manifest.io.inputs:
        lo, opt, hi = profile[t.name]
        assert len(lo) == len(t.shape) and all(1 <= a <= b <= c for a, b, c in zip(lo, opt, hi)), t
        assert all(
            a == b == c == d for d, a, b, c in zip(t.shape, lo, opt, hi) if isinstance(d, int)
        )
    seqs, tokens = limits.max_num_seqs, limits.max_num_tokens
    per_seq = -(-limits.max_seq_len // bs)
    assert profile["input_ids"] == ((1,), (min(seqs, tokens),), (tokens,))
    assert profile["query_start_loc"][2] == (seqs + 1,) and profile["block_tables"][2] == (
        seqs,
        per_seq,
    )
    assert profile["logits_indices"][2] == (tokens,)  # trtc eval asks for every position
    assert profile["kv_cache.0"][2][1] == seqs * per_seq


def int4_node_graph(attrs: dict) -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    k, n, g = attrs.get("in_features", 64), 48, 2
    q = numpy_helper.from_array(np.arange(n * k // 2, dtype=np.uint8).reshape(n, k // 2), "q")
    z = numpy_helper.from_array(np.full((n, g), 8, np.uint8), "z")
    s = numpy_helper.from_array(np.full((n, g), 0.01, np.float16), "s")
    node = helper.make_node(
        "Int4Gemm", ["x", "q", "s", "z"], ["y"], name="layers.0.q_proj", domain=DOMAIN, **attrs
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["t", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["t", n])],
        [q, z, s],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)]
    )


def test_prepare_graph_names_the_plugin_and_carries_uint8_as_int8():
    from onnx import numpy_helper

    from trtc.compiler.backends.tensorrt_full import prepare_graph

    model = int4_node_graph(ATTRS["Int4Gemm"])
    before = {i.name: numpy_helper.to_array(i).tobytes() for i in model.graph.initializer}
    prepared = prepare_graph(model)
    node = prepared.graph.node[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (
        attrs["plugin_version"] == str(PLUGINS["Int4Gemm"].version).encode()
        and attrs["plugin_namespace"] == DOMAIN.encode()
    )
    inits = {i.name: i for i in prepared.graph.initializer}
    assert inits["q"].data_type == inits["z"].data_type == onnx.TensorProto.INT8
    assert inits["s"].data_type == onnx.TensorProto.FLOAT16
    assert {n: numpy_helper.to_array(i).tobytes() for n, i in inits.items()} == before  # same bytes

    with pytest.raises(
        BuildError, match=r"node layers.0.q_proj: trtc::Int4Gemm: field out_features is missing"
    ):
        prepare_graph(int4_node_graph({"group_size": 32, "in_features": 64}))


def test_timing_cache_lives_per_target_and_version_outside_the_artifact(tmp_path, monkeypatch):
    from trtc.compiler.backends.tensorrt_full import timing_cache_path

    monkeypatch.setenv("TRTC_CACHE_DIR", str(tmp_path))
    assert (
        timing_cache_path("sm90", "10.13.0.35")
        == tmp_path / "timing" / "sm90-tensorrt-10.13.0.35.cache"
    )
    assert (
        timing_cache_path("sm90", "10.13.0.35", "ampere_plus").name
        == "sm90-tensorrt-10.13.0.35-ampere_plus.cache"
    )
    monkeypatch.delenv("TRTC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert timing_cache_path("sm80", "10.0").parent == tmp_path / "xdg" / "trtc" / "timing"
