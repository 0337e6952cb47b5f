"""``Int4Gemm`` with fp16 or bf16 constant weights as ``Int4GemmFragment``: a rewrite of how a
node's weights are held rather than of which nodes run. The executor holds the weight in the
fragment kernel's layout (`trtc.plugins.int4_gemm.fragment_kernel`) instead of the plugin's
(the same packed bytes reordered, records of 4 bytes a row and group for 3 of scales and zeros).
Calls of 1..32 tokens (decode steps) run that kernel; longer ones (prefill, larger decode
batches) dequantize the layer into a transient fp16 or bf16 weight and multiply with cuBLAS."""

from __future__ import annotations

import torch

from trtc.artifact import Manifest
from trtc.runtime.executors.graph import RUNTIME_DOMAIN, Fusion, GraphNode, NodeGraph

INT4_GEMM_FRAGMENT = (RUNTIME_DOMAIN, "Int4GemmFragment")


def int4_gemm_fragment(x, attrs):
    a, bias, words, records = x
    n, k, group = attrs["out_features"], attrs["in_features"], attrs["group_size"]
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    # The rewrite checked the device.
    return [fk.fragment_gemm(a, fk.FragmentWeight(words, records, n, k, group), bias)]


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


def fuse_int4_fragments(g: NodeGraph) -> int:
    """Int4Gemm nodes whose weights the fragment kernel takes: their weights put in its layout
    (once per weight) and the node rewritten to read that. A stored weight, scale or zero
    tensor leaves the constants as soon as every node that reads it reads the fragments
    instead, so the device holds one layout, and converting a model needs one layer's worth of
    extra memory, not a model's."""
    from trtc.plugins.int4_gemm import fragment_kernel as fk

    takes = {
        i: (*n.inputs[1:4], n.attrs["group_size"])
        for i, n in enumerate(g.original)
        if n.op == ("trtc", "Int4Gemm") and g.free(i) and _takes(g, n)
    }
    packed: dict[tuple, tuple[str, str]] = {}
    for i, key in takes.items():
        n = g.original[i]
        if key not in packed:
            names = tuple(
                f"{n.inputs[1]}.fragment{len(packed)}_{part}" for part in ("words", "records")
            )
            fw = fk.fragment_pack(*(g.constants[name] for name in key[:3]), key[3])
            g.constants[names[0]], g.constants[names[1]] = fw.words, fw.records
            packed[key] = names
            for name in key[:3]:
                if name not in g.graph_outputs and all(
                    takes.get(j) in packed for j in g.readers[name]
                ):
                    del g.constants[name]
        bias = n.inputs[4] if len(n.inputs) > 4 else ""
        g.replace(
            i, GraphNode(INT4_GEMM_FRAGMENT, [n.inputs[0], bias, *packed[key]], n.outputs, n.attrs)
        )
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


FUSION = Fusion("int4_fragment", {INT4_GEMM_FRAGMENT: int4_gemm_fragment}, fuse_int4_fragments)
