"""Attention check: every layer's attention must be one `trtc::PagedAttention` node that reads
and writes that layer's KV cache, and no unfused attention (Softmax) may remain. A model whose
attention was not fused is a build error, not a warning."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from trtc import contract
from trtc.compiler.passes.base import PassResult
from trtc.errors import BuildError
from trtc.plugins import PAGED_ATTENTION
from trtc.plugins.spec import DOMAIN


def check_attention(graph: gs.Graph, num_layers: int) -> PassResult:
    result = PassResult("paged_attention")
    softmax = [n.name for n in graph.nodes if n.op == "Softmax"]
    if softmax:
        raise BuildError(
            f"attention not fused: {len(softmax)} Softmax node(s) remain "
            f"({', '.join(softmax[:3])}); every attention must be trtc::PagedAttention"
        )
    found: dict[int, gs.Node] = {}
    for node in graph.nodes:
        if node.op != PAGED_ATTENTION.op_type or node.domain != DOMAIN:
            continue
        cache_in, cache_out = node.inputs[3].name, node.outputs[1].name
        layer = next((i for i in range(num_layers) if cache_in == contract.kv_input_name(i)), None)
        if layer is None or cache_out != contract.kv_output_name(layer):
            raise BuildError(
                f"PagedAttention node {node.name} is not wired to a layer's KV cache "
                f"(reads {cache_in}, writes {cache_out})"
            )
        if layer in found:
            raise BuildError(f"layer {layer} has two PagedAttention nodes")
        node.name = f"model.layers.{layer}.self_attn.paged_attention"
        found[layer] = node
        result.count(layer)
    missing = [i for i in range(num_layers) if i not in found]
    if missing:
        raise BuildError(
            f"attention not fused in layer(s) {missing}: no trtc::PagedAttention "
            f"node reads their KV cache"
        )
    return result
