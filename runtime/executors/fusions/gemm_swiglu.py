"""``Gemm -> SwiGLU`` (the MLP's gate/up projection and its activation) as ``GemmSwiGLU``: at a
decode step's few tokens the GEMV (`trtc.plugins.kernels.gemv`) ends in SwiGLU, one kernel
fewer per layer; otherwise the two ops as they are."""

from __future__ import annotations

from trtc.runtime.executors.graph import RUNTIME_DOMAIN, Fusion, GraphNode, NodeGraph
from trtc.runtime.executors.torch_ops import gemm, swiglu

GEMM_SWIGLU = (RUNTIME_DOMAIN, "GemmSwiGLU")


def gemm_swiglu(x, attrs):
    a, weight = x[0], x[1]
    bias = x[2] if len(x) > 2 else None
    if a.is_cuda:
        from trtc.plugins.kernels import gemv

        if gemv.supports(a, weight, swiglu=True) and (bias is None or bias.dtype == a.dtype):
            return [gemv.gemv(a, weight, bias, swiglu=True)]
    return swiglu(gemm(x, attrs), {})


def _plain_linear(node: GraphNode) -> bool:
    """``y = x @ W^T (+ b)``: the form the GEMV takes."""
    a = node.attrs
    return (
        node.op == ("", "Gemm")
        and a.get("transB", 0)
        and not a.get("transA", 0)
        and a.get("alpha", 1.0) == 1.0
        and a.get("beta", 1.0) == 1.0
    )


def swiglu_reader(g: NodeGraph, i: int) -> int | None:
    """The SwiGLU node that alone reads node ``i``'s output (not yet fused), if there is one."""
    out = g.original[i].outputs[0]
    j = g.only_reader(out)
    if g.op(j) != ("trtc", "SwiGLU") or not g.free(j) or g.original[j].inputs[0] != out:
        return None
    return j


def fuse_gemm_swiglu(g: NodeGraph) -> int:
    count = 0
    for i, n in enumerate(g.original):
        if not g.free(i) or not _plain_linear(n):
            continue
        j = swiglu_reader(g, i)
        if j is None:
            continue
        g.replace(i, GraphNode(GEMM_SWIGLU, n.inputs, g.original[j].outputs, n.attrs))
        g.remove(j)
        count += 1
    return count


FUSION = Fusion("gemm_swiglu", {GEMM_SWIGLU: gemm_swiglu}, fuse_gemm_swiglu)
