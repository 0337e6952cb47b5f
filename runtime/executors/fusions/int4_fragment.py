"""``Int4Gemm`` with fp16 or bf16 constant weights as ``Int4GemmFragment``: a rewrite of how a
node's weights are held rather than of which nodes run. The executor holds the weight in the
fragment kernel's layout (`trtc.plugins.int4_gemm.fragment_kernel`) instead of the plugin's
(the same packed bytes reordered, records of 4 bytes a row and group for 3 of scales and zeros).
Calls of 1..32 tokens (decode steps) run that kernel; longer ones (prefill, larger decode
batches) dequantize the layer into a transient fp16 or bf16 weight and multiply with cuBLAS.

A gate/up Int4Gemm read only by SwiGLU becomes ``Int4GemmFragmentSwiGLU``: its rows (and bias)
interleaved in the layout so that each lane holds the gate and up sums of one output, and the
kernel ends in SwiGLU (one launch and one ``[T, 2I]`` round trip fewer a layer, the same bits)."""

from __future__ import annotations

import torch

from trtc.artifact import Manifest
from trtc.runtime.executors.fusions.gemm_swiglu import swiglu_reader
from trtc.runtime.executors.graph import RUNTIME_DOMAIN, Fusion, GraphNode, NodeGraph
from trtc.runtime.executors.torch_ops import swiglu

INT4_GEMM_FRAGMENT = (RUNTIME_DOMAIN, "Int4GemmFragment")
INT4_GEMM_FRAGMENT_SWIGLU = (RUNTIME_DOMAIN, "Int4GemmFragmentSwiGLU")


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


def fuse_int4_fragments(g: NodeGraph) -> int:
    """Int4Gemm nodes whose weights the fragment kernel takes: their weights put in its layout
    (once per weight; a gate/up projection's rows interleaved, with its SwiGLU taken in) and the
    node rewritten to read that. A stored weight, scale or zero tensor leaves the constants as
    soon as every node that reads it reads the fragments instead, so the device holds one
    layout, and converting a model needs one layer's worth of extra memory, not a model's."""
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    taken = [
        i
        for i, n in enumerate(g.original)
        if n.op == ("trtc", "Int4Gemm") and g.free(i) and _takes(g, n)
    ]
    swiglus = {i: _swiglu_reader(g, i) for i in taken}
    takes = {
        i: (*g.original[i].inputs[1:4], g.original[i].attrs["group_size"], swiglus[i] is not None)
        for i in taken
    }
    packed: dict[tuple, tuple[str, str]] = {}
    for i, key in takes.items():
        n = g.original[i]
        interleaved = key[4]
        if key not in packed:
            names = tuple(
                f"{n.inputs[1]}.fragment{len(packed)}_{part}" for part in ("words", "records")
            )
            stored = [g.constants[name] for name in key[:3]]
            if interleaved:
                stored = [fk.interleave_gate_up(t) for t in stored]
            fw = fk.fragment_pack(*stored, key[3])
            g.constants[names[0]], g.constants[names[1]] = fw.words, fw.records
            packed[key] = names
            for name in key[:3]:
                if name not in g.graph_outputs and all(
                    takes.get(j) in packed for j in g.readers[name]
                ):
                    del g.constants[name]
        bias = n.inputs[4] if len(n.inputs) > 4 else ""
        if not interleaved:
            inputs = [n.inputs[0], bias, *packed[key]]
            g.replace(i, GraphNode(INT4_GEMM_FRAGMENT, inputs, n.outputs, n.attrs))
            continue
        if bias:
            g.constants[f"{bias}.interleaved"] = fk.interleave_gate_up(g.constants[bias])
            if bias not in g.graph_outputs and g.readers[bias] == [i]:
                del g.constants[bias]
            bias = f"{bias}.interleaved"
        j = swiglus[i]
        inputs = [n.inputs[0], bias, *packed[key]]
        g.replace(i, GraphNode(INT4_GEMM_FRAGMENT_SWIGLU, inputs, g.original[j].outputs, n.attrs))
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
    {INT4_GEMM_FRAGMENT: int4_gemm_fragment, INT4_GEMM_FRAGMENT_SWIGLU: int4_gemm_fragment_swiglu},
    fuse_int4_fragments,
)
