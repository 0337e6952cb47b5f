"""``Int4Gemm`` with fp16 or bf16 constant weights as ``Int4GemmFragment``: a rewrite of how a
node's weights are held rather than of which nodes run. The executor holds the weight in the
fragment kernel's layout (`trtc.plugins.int4_gemm.fragment_kernel`) instead of the plugin's
(the same packed bytes reordered, records of 4 bytes a row and group for 3 of scales and zeros).
Calls of 1..32 tokens (decode steps) run that kernel; longer ones (prefill, larger decode
batches) dequantize the layer into a transient fp16 or bf16 weight and multiply with cuBLAS.

A gate/up Int4Gemm read only by SwiGLU becomes ``Int4GemmFragmentSwiGLU``: its rows (and bias)
interleaved in the layout so that each lane holds the gate and up sums of one output, and the
kernel ends in SwiGLU (one launch and one ``[T, 2I]`` round trip fewer a layer, the same bits).
Likewise a merged q/k/v Int4Gemm read only by ``QKVRotaryCacheWrite`` (the earlier fusion)
becomes ``Int4GemmFragmentRotary``: each head's rows interleaved so that a lane holds both
halves of its rotations, and the kernel ends in the rotary and the cache write."""

from __future__ import annotations

import torch

from trtc.artifact import Manifest
from trtc.runtime.executors.fusions.gemm_swiglu import swiglu_reader
from trtc.runtime.executors.fusions.qkv_rotary_cache_write import QKV_ROTARY_CACHE_WRITE
from trtc.runtime.executors.graph import RUNTIME_DOMAIN, Fusion, GraphNode, NodeGraph
from trtc.runtime.executors.torch_ops import swiglu

INT4_GEMM_FRAGMENT = (RUNTIME_DOMAIN, "Int4GemmFragment")
INT4_GEMM_FRAGMENT_SWIGLU = (RUNTIME_DOMAIN, "Int4GemmFragmentSwiGLU")
INT4_GEMM_FRAGMENT_ROTARY = (RUNTIME_DOMAIN, "Int4GemmFragmentRotary")


def _weight(x, attrs):
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    n, k, group = attrs["out_features"], attrs["in_features"], attrs["group_size"]
    return fk.FragmentWeight(x[2], x[3], n, k, group)


def int4_gemm_fragment(x, attrs):
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    # The rewrite checked the device.
    return [fk.fragment_gemm(x[0], _weight(x, attrs), x[1])]


def _swiglu(y: torch.Tensor) -> torch.Tensor:
    """The executor's own SwiGLU op on one tensor (the fused node's path for long calls)."""
    return swiglu([y], {})[0]


def int4_gemm_fragment_swiglu(x, attrs):
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    return [fk.fragment_gemm_swiglu(x[0], _weight(x, attrs), _swiglu, x[1])]


def _rotary(x, attrs):
    """`fk.RotaryWrite` of an ``Int4GemmFragmentRotary`` node's inputs (after the layer's)."""
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    scales = attrs.get("k_scale", 1.0), attrs.get("v_scale", 1.0)
    # cos, sin, positions, kv_cache, slot_mapping: QKVRotaryCacheWrite's inputs after q/k/v
    return fk.RotaryWrite(*x[4:9], attrs["num_heads"], attrs["num_kv_heads"], *scales)


def int4_gemm_fragment_rotary(x, attrs):
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    return [fk.fragment_gemm_rotary(x[0], _weight(x, attrs), _rotary(x, attrs), x[1])]


def _takes(g: NodeGraph, node: GraphNode) -> bool:
    """The fragment kernel takes this node's weights, on their device."""
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    qweight, scales, zeros = (g.constants.get(name) for name in node.inputs[1:4])
    a = node.attrs
    return (
        qweight is not None
        and scales is not None
        and zeros is not None
        and scales.dtype in (torch.float16, torch.bfloat16)
        and fk.device_supports(qweight.device)
        and not fk.fragment_supports(a["out_features"], a["in_features"], a["group_size"])
    )


def _swiglu_reader(g: NodeGraph, i: int) -> int | None:
    """The SwiGLU node that alone reads Int4Gemm ``i``'s output, if its rows can interleave."""
    n = g.original[i]
    bias = n.inputs[4] if len(n.inputs) > 4 else ""
    if n.attrs["out_features"] % 16 or (bias and not g.is_constant(bias)):
        return None
    return swiglu_reader(g, i)


def _rotary_reader(g: NodeGraph, i: int) -> int | None:
    """The ``QKVRotaryCacheWrite`` node that alone reads Int4Gemm ``i``'s output, if its rows
    can interleave (heads of a multiple of 16 that make up the layer; a constant bias) and its
    other inputs exist where node ``i`` runs (the fused node runs there)."""
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    n = g.original[i]
    bias = n.inputs[4] if len(n.inputs) > 4 else ""
    j = g.only_reader(n.outputs[0])
    node = g.current(j)
    if node is None or node.op != QKV_ROTARY_CACHE_WRITE or node.inputs[0] != n.outputs[0]:
        return None
    a = node.attrs
    shape = (n.attrs["out_features"], a["num_heads"], a["num_kv_heads"], a["head_dim"])
    if fk.rotary_refusal(*shape) or (bias and not g.is_constant(bias)):
        return None
    if not all(g.ready_before(t, i) for t in node.inputs[1:]):
        return None
    return j


def _interleave(layout: tuple, t: torch.Tensor) -> torch.Tensor:
    """A stored tensor's rows in ``layout``'s order: ``("plain",)``, ``("gate_up",)`` or
    ``("rotary", head_dim)``."""
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    if layout[0] == "gate_up":
        return fk.interleave_gate_up(t)
    if layout[0] == "rotary":
        return fk.interleave_rotary(t, layout[1])
    return t


def fuse_int4_fragments(g: NodeGraph) -> int:
    """Int4Gemm nodes whose weights the fragment kernel takes: their weights put in its layout
    (once per weight and row order; a gate/up projection's rows interleaved, with its SwiGLU
    taken in; a q/k/v projection's, with its rotary and cache write) and the node rewritten to
    read that. A stored weight, scale or zero tensor leaves the constants as
    soon as every node that reads it reads the fragments instead, so the device holds one
    layout, and converting a model needs one layer's worth of extra memory, not a model's."""
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    taken = [
        i
        for i, n in enumerate(g.original)
        if n.op == ("trtc", "Int4Gemm") and g.free(i) and _takes(g, n)
    ]
    # Which epilogue each node takes in: (reader node, row layout) or None.
    epilogues: dict[int, tuple[int, tuple] | None] = {}
    for i in taken:
        if (j := _swiglu_reader(g, i)) is not None:
            epilogues[i] = (j, ("gate_up",))
        elif (j := _rotary_reader(g, i)) is not None:
            epilogues[i] = (j, ("rotary", g.current(j).attrs["head_dim"]))
        else:
            epilogues[i] = None
    takes = {
        i: (
            *g.original[i].inputs[1:4],
            g.original[i].attrs["group_size"],
            epilogues[i][1] if epilogues[i] else ("plain",),
        )
        for i in taken
    }
    packed: dict[tuple, tuple[str, str]] = {}
    for i, key in takes.items():
        n = g.original[i]
        layout = key[4]
        if key not in packed:
            names = tuple(
                f"{n.inputs[1]}.fragment{len(packed)}_{part}" for part in ("words", "records")
            )
            stored = [_interleave(layout, g.constants[name]) for name in key[:3]]
            fw = fk.fragment_pack(*stored, key[3])
            g.constants[names[0]], g.constants[names[1]] = fw.words, fw.records
            packed[key] = names
            for name in key[:3]:
                if name not in g.graph_outputs and all(
                    takes.get(j) in packed for j in g.readers[name]
                ):
                    del g.constants[name]
        bias = n.inputs[4] if len(n.inputs) > 4 else ""
        if epilogues[i] is None:
            inputs = [n.inputs[0], bias, *packed[key]]
            g.replace(i, GraphNode(INT4_GEMM_FRAGMENT, inputs, n.outputs, n.attrs))
            continue
        if bias:
            name = f"{bias}.{layout[0]}"
            g.constants[name] = _interleave(layout, g.constants[bias])
            if bias not in g.graph_outputs and g.readers[bias] == [i]:
                del g.constants[bias]
            bias = name
        j = epilogues[i][0]
        reader = g.current(j)
        inputs = [n.inputs[0], bias, *packed[key]]
        if layout[0] == "gate_up":
            fused = GraphNode(INT4_GEMM_FRAGMENT_SWIGLU, inputs, reader.outputs, n.attrs)
        else:  # the rotary operands after the layer's: cos, sin, positions, cache, slots
            attrs = {**reader.attrs, **n.attrs}
            fused = GraphNode(
                INT4_GEMM_FRAGMENT_ROTARY, inputs + reader.inputs[1:], reader.outputs, attrs
            )
        g.replace(i, fused)
        g.remove(j)
    return len(takes)


def _largest_linear(m: Manifest) -> int:
    """Weights of the largest projection of a decoder layer (q/k/v fused, gate/up fused)."""
    g = m.model
    h, d, inter = g.hidden_size, g.head_dim, g.intermediate_size
    return max(
        (g.num_heads + 2 * g.num_kv_heads) * d * h, h * g.num_heads * d, 2 * inter * h, h * inter
    )


def int4_fragment_bytes(manifest: Manifest) -> int:
    """What the rewrite may add to an artifact's device memory, from its manifest (before
    loading it): the fragment layout's larger records, every quantized Linear taken, and the
    transient fp16 weight of the largest projection that a prefill call dequantizes; 0 where
    the rewrite takes none (no INT4, fp32 activations, a group size the kernel does not take)."""
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    quant = manifest.quantization
    if (
        quant.bits != 4
        or manifest.precision not in ("fp16", "bf16")
        or quant.group_size not in fk.GROUP_SIZES
    ):
        return 0
    whole = fk.fragment_extra_bytes(
        quant.linear_weight_bytes_quantized, quant.group_size
    ) + 2 * _largest_linear(manifest)
    return whole // manifest.parallel.tensor  # a rank holds its share of every Linear


FUSION = Fusion(
    "int4_fragment",
    {
        INT4_GEMM_FRAGMENT: int4_gemm_fragment,
        INT4_GEMM_FRAGMENT_SWIGLU: int4_gemm_fragment_swiglu,
        INT4_GEMM_FRAGMENT_ROTARY: int4_gemm_fragment_rotary,
    },
    fuse_int4_fragments,
)
