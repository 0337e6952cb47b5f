"""``Add -> RMSNormalization`` (a residual add and the norm that reads its sum) as one
``AddRMSNorm``: both outputs in one pass over the row."""

from __future__ import annotations

from trtc.runtime.executors.graph import RUNTIME_DOMAIN, Fusion, GraphNode, NodeGraph
from trtc.runtime.executors.torch_ops import rms_norm

ADD_RMS_NORM = (RUNTIME_DOMAIN, "AddRMSNorm")


def add_rms_norm(x, attrs):
    a, b, weight = x
    last_axis = attrs.get("axis", -1) % a.dim() == a.dim() - 1
    if a.shape != b.shape or not last_axis or attrs.get("stash_type", 1) != 1:
        total = a + b  # a broadcasting Add: the two ops as they are
        return [total, rms_norm([total, weight], attrs)[0]]
    from trtc.plugins.kernels import pointwise

    return list(pointwise.add_rms_norm(a, b, weight, attrs.get("epsilon", 1e-5)))


def fuse_add_rms_norm(g: NodeGraph) -> int:
    count = 0
    for i, n in enumerate(g.original):
        if n.op != ("", "Add") or not g.free(i) or any(g.is_constant(t) for t in n.inputs):
            continue
        norms = [
            j
            for j in g.readers.get(n.outputs[0], [])
            if g.op(j) == ("", "RMSNormalization")
            and g.free(j)
            and g.original[j].inputs[0] == n.outputs[0]
        ]
        if not norms:
            continue
        norm = g.original[norms[0]]
        g.replace(
            i,
            GraphNode(
                ADD_RMS_NORM,
                [*n.inputs, norm.inputs[1]],
                [n.outputs[0], norm.outputs[0]],
                norm.attrs,
            ),
        )
        g.remove(norms[0])
        count += 1
    return count


FUSION = Fusion("add_rms_norm", {ADD_RMS_NORM: add_rms_norm}, fuse_add_rms_norm)
