"""The CUDA executor's load-time rewrites, one file each, applied in this order.

A decode step of a small model costs about as much per kernel as per byte of weights, so the
executor runs fewer, larger kernels; each fused node computes exactly what its nodes compute one
after the other (the tests run both and compare). The ops of the fused nodes are in
`RUNTIME_OPS`, which the CUDA executor adds to its op table."""

from __future__ import annotations

from collections import Counter

import torch

from trtc.runtime.executors.fusions import (
    add_rms_norm,
    gemm_swiglu,
    int4_fragment,
    qkv_rotary_cache_write,
)
from trtc.runtime.executors.graph import GraphNode, NodeGraph, OpTable

# q/k/v first: it takes the Split and the attention before anything else looks at them.
KERNEL_FUSIONS = (qkv_rotary_cache_write.FUSION, add_rms_norm.FUSION, gemm_swiglu.FUSION)
INT4_FRAGMENTS = int4_fragment.FUSION

RUNTIME_OPS: OpTable = {
    op: fn for f in (*KERNEL_FUSIONS, INT4_FRAGMENTS) for op, fn in f.ops.items()
}


def fuse(
    nodes: list[GraphNode],
    constants: dict[str, torch.Tensor],
    graph_outputs: set[str],
    int4_fragments: bool = True,
) -> tuple[list[GraphNode], Counter]:
    """The node list with every fusion applied, and how many of each were made.
    ``int4_fragments``: the Int4Gemm layout rewrite (it adds the fragment layout to
    ``constants`` and removes the stored tensors it replaces)."""
    g = NodeGraph(nodes, constants, graph_outputs)
    counts = Counter({f.name: f.apply(g) for f in KERNEL_FUSIONS})
    counts[INT4_FRAGMENTS.name] = INT4_FRAGMENTS.apply(g) if int4_fragments else 0
    return g.nodes(), counts
