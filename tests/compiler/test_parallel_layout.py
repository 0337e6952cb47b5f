"""Tensor-parallel builds: the split refused before any work where the model cannot take it,
each rank's graph holding exactly its slice of the one-rank artifact's weights, and the
row-parallel INT4 and FP8 slices summing to the whole projection."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from trtc.artifact import ModelGeometry, read_manifest
from trtc.compiler.parallel import (
    check_tensor_parallel,
    rank_geometry,
    rank_shard,
    tensor_slice,
)
from trtc.errors import ConfigError
from trtc.plugins.fp8_gemm.reference import fp8_gemm
from trtc.plugins.int4_gemm import int4_gemm, pack_int4


def geometry(heads=32, kv_heads=8, intermediate=14336, head_dim=128) -> ModelGeometry:
    return ModelGeometry(
        architecture="LlamaForCausalLM",
        num_layers=2,
        hidden_size=heads * head_dim,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=1000,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        sliding_windows=(0, 0),
    )


@pytest.mark.parametrize(
    "g,n,expect",
    [
        (geometry(heads=9, kv_heads=3, head_dim=64), 2, "does not divide the model's 9 query"),
        (geometry(intermediate=1004), 8, "intermediate_size 1004"),
        (geometry(heads=12, kv_heads=3), 4, "3 KV heads neither divide by 4 nor divide 4"),
    ],
)
def test_splits_the_model_cannot_take_are_refused(g, n, expect):
    with pytest.raises(ConfigError, match="^parallel.tensor: ") as e:
        check_tensor_parallel(n, g)
    assert expect in str(e.value)
    assert "splits over" in str(e.value)  # and says what would work


def test_int4_shards_must_be_whole_groups():
    g = geometry(heads=8, kv_heads=8, head_dim=64, intermediate=1024 + 64)
    check_tensor_parallel(2, g, "rtn", 32)  # 544 input features a rank: 17 groups of 32
    with pytest.raises(ConfigError, match="not whole INT4 groups of 128"):
        check_tensor_parallel(2, g, "rtn", 128)
    check_tensor_parallel(2, g, "fp8", 128)  # FP8 scales are per row: any split


def test_more_ranks_than_kv_heads_share_the_head_their_queries_use():
    g = geometry(heads=8, kv_heads=2, head_dim=16, intermediate=64)
    assert rank_geometry(g, 4).num_kv_heads == 1
    for rank in range(4):
        shard = rank_shard(g, 4, rank)
        q0 = shard.heads[0]
        # GQA: query head h reads KV head h // (heads / kv_heads)
        assert shard.kv_heads == (q0 // 4, q0 // 4 + 1)
        assert tensor_slice("model.layers.0.self_attn.k_proj.weight", shard, g) == (
            0,
            shard.kv_heads[0] * 16,
            shard.kv_heads[1] * 16,
            2 * 16,  # the checkpoint's whole k_proj: both KV heads
        )
    # Row-parallel biases are added once, after the sum: every rank holds them whole.
    assert tensor_slice("model.layers.0.self_attn.o_proj.bias", rank_shard(g, 4, 1), g) is None


def test_the_build_config_refuses_tensor_parallel_rtx_before_any_work(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "model: {source: tiny, name: tiny-llama}\nparallel: {tensor: 2}\n"
        "backend: {name: tensorrt-rtx, targets: [sm86]}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "trtc", "build", str(config), "--output", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "parallel.tensor: 2 ranks need an all-reduce" in lines[0]
    assert not (tmp_path / "o").exists()


def test_heads_that_do_not_divide_fail_at_check_in_one_line(tmp_path):
    config = tmp_path / "c.yaml"  # tiny models have 4 query heads
    config.write_text("model: {source: tiny, name: tiny-llama}\nparallel: {tensor: 8}\n")
    r = subprocess.run(
        [sys.executable, "-m", "trtc", "build", str(config), "--output", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: parallel.tensor: 8 does not divide the model's 4 query heads "
        "(num_attention_heads) (this model splits over 1, 2, 4 ranks)"
    ], r.stderr
    assert "load" not in r.stderr.split("error:")[0]  # refused before the weights load
    assert not (tmp_path / "o").exists()


def _initializers(path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen2"])
def test_each_rank_holds_its_slice_of_the_one_rank_weights(tiny_artifacts, tp_artifacts, name):
    one, two = tiny_artifacts[name], tp_artifacts[name]
    manifest = read_manifest(two)
    g = manifest.model
    assert manifest.parallel.tensor == 2 and read_manifest(one).parallel.tensor == 1
    assert "parallel" not in json.loads((one / "manifest.json").read_text())
    assert manifest.kv_cache.num_kv_heads == max(1, g.num_kv_heads // 2)
    assert manifest.parallel.kv_heads_replicated == (g.num_kv_heads < 2)
    whole = _initializers(one / "model.onnx")
    d = g.head_dim
    for rank in range(2):
        shard = rank_shard(g, 2, rank)
        ops = [n.op_type for n in onnx.load(str(two / f"rank{rank}/model.onnx")).graph.node]
        assert ops.count("AllReduce") == 2 * g.num_layers
        part = _initializers(two / f"rank{rank}" / "model.onnx")
        assert set(part) <= set(whole)
        for key, value in part.items():
            full = whole[key]
            if key.endswith("qkv_proj.weight") or key.endswith("qkv_proj.bias"):
                q, k, v = np.split(full, [g.num_heads * d, (g.num_heads + g.num_kv_heads) * d])
                h0, h1 = shard.heads[0] * d, shard.heads[1] * d
                k0, k1 = shard.kv_heads[0] * d, shard.kv_heads[1] * d
                expect = np.concatenate([q[h0:h1], k[k0:k1], v[k0:k1]])
            elif key.endswith("gate_up_proj.weight"):
                gate, up = np.split(full, 2)
                i0, i1 = shard.intermediate
                expect = np.concatenate([gate[i0:i1], up[i0:i1]])
            elif key.endswith("o_proj.weight"):
                expect = full[:, shard.heads[0] * d : shard.heads[1] * d]
            elif key.endswith("down_proj.weight"):
                expect = full[:, shard.intermediate[0] : shard.intermediate[1]]
            elif key.endswith(".sizes"):
                continue  # the merged GEMM's split sizes: the rank's own
            elif key.startswith("rope_"):
                # Computed by transformers' rotary module at each build, not read: seen to
                # differ in the last digits between builds of one process (1.5e-4, rarely).
                np.testing.assert_allclose(value, full, rtol=0, atol=1e-3)
                continue
            else:
                expect = full  # embedding, head, norms, rotary tables: replicated
            assert np.array_equal(_bits(value), _bits(expect)), (rank, key)


def _rtn_linear(n: int, k: int, group: int):
    from trtc.compiler.quantize.rtn import quantize_rtn

    torch.manual_seed(0)
    q, scales, zeros = quantize_rtn(torch.randn(n, k), group)
    return {"qweight": pack_int4(q), "scales": scales, "zeros": zeros}


def test_row_parallel_int4_slices_sum_to_the_whole_projection():
    g = geometry(heads=4, kv_heads=2, head_dim=32, intermediate=128)
    group, x = 32, torch.randn(3, 128)
    tensors = _rtn_linear(64, 128, group)  # down_proj: 128 input features, 64 output
    whole = int4_gemm(x, **tensors, group_size=group, in_features=128, out_features=64)
    total = torch.zeros_like(whole)
    for rank in range(2):
        shard = rank_shard(g, 2, rank)
        part = {}
        for leaf, t in tensors.items():
            dim, start, stop, _ = tensor_slice(
                f"model.layers.0.mlp.down_proj.{leaf}", shard, g, group
            )
            part[leaf] = t.narrow(dim, start, stop - start)
        cols = slice(*shard.intermediate)
        total += int4_gemm(x[:, cols], **part, group_size=group, in_features=64, out_features=64)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_row_parallel_fp8_slices_sum_to_the_whole_projection():
    g = geometry(heads=4, kv_heads=2, head_dim=16, intermediate=128)
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    weight_scale = w.abs().amax(1) / 448
    weight = (w / weight_scale[:, None]).to(torch.float8_e4m3fn)
    input_scale, x = torch.tensor(0.01), torch.randn(3, 64)
    tensors = {"weight": weight, "weight_scale": weight_scale, "input_scale": input_scale}
    whole = fp8_gemm(x, **tensors, in_features=64, out_features=64)
    total = torch.zeros_like(whole)
    for rank in range(2):
        shard = rank_shard(g, 2, rank)
        part = {}
        for leaf, t in tensors.items():
            where = tensor_slice(f"model.layers.0.self_attn.o_proj.{leaf}", shard, g)
            part[leaf] = t if where is None else t.narrow(where[0], where[1], where[2] - where[1])
        cols = slice(shard.heads[0] * 16, shard.heads[1] * 16)
        total += fp8_gemm(x[:, cols], **part, in_features=32, out_features=64)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def _onnxruntime_rank(rank: int, artifact: str, port: int, out: str) -> None:
    """One rank of the compiled graphs in onnxruntime, its AllReduce over a gloo group."""
    import torch.distributed as dist

    from harness.onnx_reference import OnnxReferenceRunner
    from trtc.contract import SequenceWork
    from trtc.plugins.all_reduce import use_group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    use_group(dist.group.WORLD)
    try:
        runner = OnnxReferenceRunner(artifact, num_blocks=8, rank=rank)
        logits = [runner.step([SequenceWork(list(range(10, 40)), 0, [0, 1])])]
        logits.append(runner.step([SequenceWork([5], 30, [0, 1])]))
        if rank == 0:
            np.save(out, np.concatenate(logits))
        dist.barrier()  # both ranks done before either tears its group down
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown, where onnxruntime's and gloo's threads were
    # once seen to abort the process ("terminate called without an active exception").
    os._exit(0)


@pytest.mark.parametrize("name", ["tiny-mistral", "tiny-qwen2"])
def test_rank_graphs_in_onnxruntime_sum_to_the_one_rank_graph(
    tiny_artifacts, tp_artifacts, tmp_path, name
):
    from harness.onnx_reference import OnnxReferenceRunner
    from harness.serving import free_port
    from trtc.contract import SequenceWork

    one = OnnxReferenceRunner(tiny_artifacts[name], num_blocks=8)
    expect = np.concatenate(
        [
            one.step([SequenceWork(list(range(10, 40)), 0, [0, 1])]),
            one.step([SequenceWork([5], 30, [0, 1])]),
        ]
    )
    out = tmp_path / "logits.npy"
    torch.multiprocessing.spawn(
        _onnxruntime_rank, (str(tp_artifacts[name]), free_port(), str(out)), nprocs=2
    )
    np.testing.assert_allclose(np.load(out), expect, rtol=0, atol=1e-4)
