"""The CUDA executor's kernel fusion (runtime/executors/fusions/): the fused node list computes
what the compiled graph computes. Without a GPU the fused Triton kernels run in Triton's CPU
interpreter."""

from __future__ import annotations

import onnx
import pytest
import torch

from trtc.artifact import Artifact
from trtc.contract import SequenceWork, make_step
from trtc.runtime.executors.fusions import RUNTIME_OPS, fuse
from trtc.runtime.executors.graph import GraphNode
from trtc.runtime.executors.torch_executor import TorchExecutor
from trtc.runtime.executors.torch_executor import _attrs as node_attrs
from trtc.runtime.executors.torch_ops import ONNX_OPS

pytest.importorskip("triton", reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class FusedExecutor(TorchExecutor):
    """The torch executor running the fused node list (as the CUDA executor does)."""

    ops = {**ONNX_OPS, **RUNTIME_OPS}

    def rewrite(self, graph):
        fused, self.fusions = fuse(graph, self.constants, self.graph_outputs)
        return fused


def run_steps(ex, steps):
    return [ex.execute(make_step(w, 16)).float().cpu() for w in steps]


def plain_and_fused(artifact) -> tuple[TorchExecutor, FusedExecutor]:
    return (
        TorchExecutor(Artifact.open(artifact), 16, DEVICE),
        FusedExecutor(Artifact.open(artifact), 16, DEVICE),
    )


def assert_same_steps(plain, fused, tol: float = 1e-5, kv: bool = True) -> None:
    """A prefill of two sequences (57 tokens) and two decode steps of 2: same logits within
    ``tol``, and (``kv``) the same KV cache."""
    prompts, tables = [list(range(7, 47)), list(range(100, 117))], [[3, 5, 8], [1, 2]]
    steps = [[SequenceWork(p, 0, t) for p, t in zip(prompts, tables)]]
    steps += [
        [SequenceWork([9 + i], len(p) + i, t) for p, t in zip(prompts, tables)] for i in range(2)
    ]
    for a, b in zip(run_steps(plain, steps), run_steps(fused, steps)):
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)
    if kv:
        torch.testing.assert_close(fused.kv_pool.cpu(), plain.kv_pool.cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])  # GQA; MQA with a sliding window
def test_fused_graph_matches_the_compiled_graph(tiny_artifacts, name):
    art = tiny_artifacts[name]
    plain, fused = plain_and_fused(art)
    # 2 layers: q/k/v rotary + cache write per layer; every residual Add feeds a norm but the
    # last; the gate/up projection and its SwiGLU per layer.
    assert fused.fusions == {
        "qkv_rotary_cache_write": 2,
        "add_rms_norm": 3,
        "gemm_swiglu": 2,
        "int4_fragment": 0,
    }
    assert len(fused.nodes) == len(plain.nodes) - 2 * 6 - 3 - 2
    assert_same_steps(plain, fused)


def test_qk_norm_layers_keep_their_rotary_and_cache_write(tiny_artifacts):
    """Qwen3 normalises q and k per head between the Split and the rotary embedding, which
    `QKVRotaryCacheWrite` does not compute: those layers keep the plain nodes (and the plugin's
    own cache write) and give the same logits and cache; the other fusions still apply."""
    art = tiny_artifacts["tiny-qwen3"]
    plain, fused = plain_and_fused(art)
    assert fused.fusions == {
        "qkv_rotary_cache_write": 0,
        "add_rms_norm": 3,
        "gemm_swiglu": 2,
        "int4_fragment": 0,
    }
    assert len(fused.nodes) == len(plain.nodes) - 3 - 2
    op_of = {fn: op for op, fn in FusedExecutor.ops.items()}
    ops = [op_of[n[0]] for n in fused.nodes]
    assert ops.count(("trtc", "PagedAttention")) == 2 and ops.count(("", "RotaryEmbedding")) == 4
    # No Add feeds the per-head norms (q and k of 2 layers), the first layer's input norm (it
    # reads the embedding) or the final one (the logits rows): they stay RMSNormalization.
    assert ops.count(("", "RMSNormalization")) == 4 + 2
    assert_same_steps(plain, fused)


@pytest.fixture(scope="module")
def tiny_int4_fp16(tmp_path_factory):
    """tiny-llama in fp16 with INT4 (RTN, group 64) Linears: q/k/v, o and gate/up (K = 64) take
    the fragment layout, down (K = 160, no multiple of 64) does not."""
    from conftest import build_quiet
    from trtc.compiler.config import parse_config

    cfg = parse_config(
        {
            "model": {"source": "tiny", "name": "tiny-llama"},
            "precision": "fp16",
            "limits": {"max_num_tokens": 256, "max_num_seqs": 8},
            "quantization": {"method": "rtn", "group_size": 64, "partial_groups": True},
        }
    )
    return build_quiet(cfg, tmp_path_factory.mktemp("int4") / "tiny-llama-rtn")


def test_int4_fragment_layout_matches_the_compiled_graph(tiny_int4_fp16):
    plain, fused = (
        TorchExecutor(Artifact.open(tiny_int4_fp16), 16, DEVICE),
        FusedExecutor(Artifact.open(tiny_int4_fp16), 16, DEVICE),
    )
    assert fused.fusions["int4_fragment"] == 6
    added = {n for n in fused.constants if ".fragment" in n}
    assert len(added) == 12 and not added & set(plain.constants)
    # The stored layout of the 6 taken Linears is gone (weights, scales, zeros), down's stays;
    # the device holds about the same bytes (records: 4 bytes a row and group for 3).
    dropped = set(plain.constants) - set(fused.constants)
    assert len(dropped) == 18 and all(plain.constants[n].dtype != torch.float32 for n in dropped)

    def nbytes(ex, names):
        return sum(ex.constants[n].numel() * ex.constants[n].element_size() for n in names)

    # words: the packed bytes; records: 4 bytes a row and group where scales and zeros take 3
    assert nbytes(fused, {n for n in added if n.endswith("words")}) == nbytes(
        plain, {n for n in dropped if n.endswith("qweight")}
    )
    assert 3 * nbytes(fused, {n for n in added if n.endswith("records")}) == 4 * nbytes(
        plain, {n for n in dropped if not n.endswith("qweight")}
    )
    ops = [n[0] for n in fused.nodes]
    from trtc.runtime.executors.fusions.int4_fragment import (
        int4_gemm_fragment,
        int4_gemm_fragment_rotary,
        int4_gemm_fragment_swiglu,
    )
    from trtc.runtime.executors.fusions.qkv_rotary_cache_write import qkv_rotary_cache_write
    from trtc.runtime.executors.torch_ops import swiglu

    # o of both layers; gate/up with its SwiGLU taken in (no SwiGLU node left); q/k/v with the
    # rotary and the cache write taken in (no QKVRotaryCacheWrite left)
    assert ops.count(int4_gemm_fragment) == 2 and ops.count(int4_gemm_fragment_swiglu) == 2
    assert ops.count(int4_gemm_fragment_rotary) == 2
    assert swiglu not in ops and qkv_rotary_cache_write not in ops
    # The prefill through dequantized weights and a matmul, the decode steps through the
    # fragment kernel.
    assert_same_steps(plain, fused, tol=2e-2, kv=False)


def test_int4_gate_up_with_a_bias_takes_its_swiglu():
    """A gate/up Int4Gemm with a bias (no supported model has one; the rewrite takes it): the
    bias is interleaved with the rows, the stored one dropped, and the fused node computes the
    two nodes' result."""
    from harness.int4_layers import make_layer
    from trtc.runtime.executors.fusions.int4_fragment import INT4_GEMM_FRAGMENT_SWIGLU

    n, k, group = 64, 128, 64
    qweight, scales, zeros, bias = make_layer(n, k, group, torch.float16, True, 2, DEVICE)
    constants = {"qw": qweight, "s": scales, "z": zeros, "b": bias}
    attrs = {"group_size": group, "in_features": k, "out_features": n}
    nodes = [
        GraphNode(("trtc", "Int4Gemm"), ["x", "qw", "s", "z", "b"], ["gate_up"], attrs),
        GraphNode(("trtc", "SwiGLU"), ["gate_up"], ["y"], {}),
    ]
    fused, counts = fuse(nodes, constants, {"y"})
    assert counts["int4_fragment"] == 1 and len(fused) == 1
    (node,) = fused
    assert node.op == INT4_GEMM_FRAGMENT_SWIGLU and node.outputs == ["y"]
    assert "b" not in constants and torch.equal(
        constants["b.gate_up"][:16].cpu(), torch.cat((bias[:8], bias[32:40])).cpu()
    )
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    x = x.to(DEVICE)
    want = ONNX_OPS[("trtc", "SwiGLU")](
        ONNX_OPS[("trtc", "Int4Gemm")]([x, qweight, scales, zeros, bias], attrs), {}
    )[0]
    (got,) = RUNTIME_OPS[node.op]([x, *(constants[name] for name in node.inputs[1:])], attrs)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_int4_qkv_with_a_bias_takes_its_rotary_and_cache_write():
    """A q/k/v Int4Gemm with a bias read only by QKVRotaryCacheWrite: one node, the bias
    interleaved with the rows (the stored one dropped), and the same q and cache as the two
    nodes (3 tokens: one through the kernel; 40: the dequantized layer, then the write)."""
    from harness.int4_layers import make_layer
    from trtc.runtime.executors.fusions.int4_fragment import INT4_GEMM_FRAGMENT_ROTARY
    from trtc.runtime.executors.fusions.qkv_rotary_cache_write import QKV_ROTARY_CACHE_WRITE

    heads, kv_heads, d, k, group = 2, 1, 32, 128, 64
    n = (heads + 2 * kv_heads) * d
    qweight, scales, zeros, bias = make_layer(n, k, group, torch.float16, True, 4, DEVICE)
    gen = torch.Generator().manual_seed(5)
    angles = torch.rand(64, d // 2, generator=gen) * 6.3
    constants = {"qw": qweight, "s": scales, "z": zeros, "b": bias}
    constants.update(cos=angles.cos().half().to(DEVICE), sin=angles.sin().half().to(DEVICE))
    gemm = {"group_size": group, "in_features": k, "out_features": n}
    attn = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d, "scale": 0.25}
    nodes = [
        GraphNode(("trtc", "Int4Gemm"), ["x", "qw", "s", "z", "b"], ["qkv"], gemm),
        GraphNode(
            QKV_ROTARY_CACHE_WRITE, ["qkv", "cos", "sin", "pos", "cache", "slots"], ["q"], attn
        ),
    ]
    fused, counts = fuse(nodes, constants, {"q"})
    assert counts["int4_fragment"] == 1 and len(fused) == 1
    (node,) = fused
    assert node.op == INT4_GEMM_FRAGMENT_ROTARY and node.outputs == ["q"]
    assert "b" not in constants and torch.equal(
        constants["b.rotary"][:16].cpu(), torch.cat((bias[:8], bias[16:24])).cpu()
    )
    for tokens in (3, 40):
        x = torch.randn(tokens, k, generator=gen).to(torch.float16).to(DEVICE)
        pos = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
        slots = torch.randperm(64, generator=gen)[:tokens].to(DEVICE)
        caches = [
            torch.zeros(2, 4, 16, kv_heads, d, dtype=torch.float16, device=DEVICE) for _ in range(2)
        ]
        (qkv,) = ONNX_OPS[("trtc", "Int4Gemm")]([x, qweight, scales, zeros, bias], gemm)
        rest = [constants["cos"], constants["sin"], pos]
        (want,) = RUNTIME_OPS[QKV_ROTARY_CACHE_WRITE]([qkv, *rest, caches[0], slots], attn)
        layer = [constants[name] for name in node.inputs[1:4]]
        (got,) = RUNTIME_OPS[node.op]([x, *layer, *rest, caches[1], slots], node.attrs)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(caches[1], caches[0], atol=2e-3, rtol=2e-3)
        assert caches[1].count_nonzero() > 0


def test_int4_qkv_keeps_its_rotary_where_an_input_comes_later():
    """The fused node runs where the Int4Gemm was: a rotary input made by a node after it (here
    the positions) keeps the two nodes apart."""
    from harness.int4_layers import make_layer
    from trtc.runtime.executors.fusions.int4_fragment import INT4_GEMM_FRAGMENT
    from trtc.runtime.executors.fusions.qkv_rotary_cache_write import QKV_ROTARY_CACHE_WRITE

    qweight, scales, zeros, _ = make_layer(128, 128, 64, torch.float16, False, 4, DEVICE)
    constants = {"qw": qweight, "s": scales, "z": zeros}
    gemm = {"group_size": 64, "in_features": 128, "out_features": 128}
    attn = {"num_heads": 2, "num_kv_heads": 1, "head_dim": 32, "scale": 0.25}
    nodes = [
        GraphNode(("trtc", "Int4Gemm"), ["x", "qw", "s", "z"], ["qkv"], gemm),
        GraphNode(("", "Identity"), ["position_ids"], ["pos"], {}),
        GraphNode(
            QKV_ROTARY_CACHE_WRITE, ["qkv", "cos", "sin", "pos", "cache", "slots"], ["q"], attn
        ),
    ]
    fused, counts = fuse(nodes, constants, {"q"})
    assert counts["int4_fragment"] == 1
    assert [n.op for n in fused] == [INT4_GEMM_FRAGMENT, ("", "Identity"), QKV_ROTARY_CACHE_WRITE]


def test_unmatched_patterns_are_left_alone(tiny_artifacts):
    # A q projection also read by another node must keep its own rotary: that layer is not fused.
    ex = TorchExecutor(Artifact.open(tiny_artifacts["tiny-llama"]), 16)
    model = onnx.load(str(tiny_artifacts["tiny-llama"] / "model.onnx"), load_external_data=False)
    nodes = [
        GraphNode((n.domain, n.op_type), list(n.input), list(n.output), {})
        for n in model.graph.node
    ]
    nodes = [
        n._replace(attrs=dict(a)) for n, a in zip(nodes, (node_attrs(m) for m in model.graph.node))
    ]
    split = next(i for i, n in enumerate(nodes) if n.op == ("", "Split"))
    nodes.append(GraphNode(("", "Identity"), [nodes[split].outputs[0]], ["extra"], {}))
    fused, counts = fuse(nodes, ex.constants, ex.graph_outputs | {"extra"})
    assert counts["qkv_rotary_cache_write"] == 1
    assert nodes[split] in fused


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype, int4", [("auto", False), ("fp8", False), ("auto", True)])
def test_cuda_executor_fused_matches_unfused(tmp_path_factory, kv_dtype, int4):
    from conftest import build_quiet
    from trtc.compiler.config import parse_config
    from trtc.runtime.executors.cuda_executor import CudaExecutor

    quant = {"calibration": {"num_samples": 4, "seq_len": 64}}
    if int4:
        quant.update(method="rtn", group_size=64, partial_groups=True)
    cfg = parse_config(
        {
            "model": {"source": "tiny", "name": "tiny-llama"},
            "precision": "fp16",
            "kv_cache": {"dtype": kv_dtype},
            "limits": {"max_num_tokens": 256, "max_num_seqs": 8},
            "quantization": quant,
        }
    )
    art = build_quiet(cfg, tmp_path_factory.mktemp("fusion") / f"{kv_dtype}-{int4}")
    plain = CudaExecutor(Artifact.open(art), 64, fuse_kernels=False)
    fused = CudaExecutor(Artifact.open(art), 64)
    if int4:  # the decode graphs run the fragment kernel: q/k/v, o and gate/up of 2 layers
        assert fused.fusions["int4_fragment"] == 6 and fused.fusions["gemm_swiglu"] == 0
    else:
        assert fused.fusions["qkv_rotary_cache_write"] == 2 and fused.fusions["gemm_swiglu"] == 2
    prompts, tables = [list(range(7, 47)), list(range(100, 117))], [[3, 5, 8], [1, 2]]
    steps = [[SequenceWork(p, 0, t) for p, t in zip(prompts, tables)]]
    steps += [
        [SequenceWork([9 + i], len(p) + i, t) for p, t in zip(prompts, tables)] for i in range(4)
    ]
    for a, b in zip(run_steps(plain, steps), run_steps(fused, steps)):  # decode steps replay graphs
        torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)
    a, b = plain.kv_pool.float(), fused.kv_pool.float()
    # The two rotary spellings may round apart (fp16, or an E4M3 step): close, by METHOD.md's
    # measure ||fused - plain|| / ||plain||.
    err = float((a - b).norm() / a.norm())
    assert err < (2e-2 if kv_dtype == "fp8" else 1e-3), f"KV pools differ by {err:.2e}"
