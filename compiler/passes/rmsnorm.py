"""RMSNorm fusion: ``w * cast(xf * 1/sqrt(mean(xf^2) + eps))`` -> ONNX ``RMSNormalization``
(opset 23) with fp32 stash type, the precision transformers computes it in. Over the last axis of
any rank: the hidden-size norms read ``[T, hidden]``, Qwen3's per-head q/k norms
``[T, heads, head_dim]``."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from trtc.compiler.passes.base import (
    PassResult,
    const_value,
    is_scalar,
    only_consumer,
    other_operand,
    producer,
    weight_layer,
)


def _strip_cast(tensor: gs.Tensor) -> gs.Tensor:
    cast = producer(tensor, "Cast")
    return cast.inputs[0] if cast is not None else tensor


def fuse_rmsnorm(graph: gs.Graph) -> PassResult:
    result = PassResult("rmsnorm")
    for mean in [n for n in graph.nodes if n.op == "ReduceMean"]:
        pow_ = producer(mean.inputs[0], "Pow")
        if pow_ is None or not is_scalar(pow_.inputs[1], 2.0):
            continue
        xf = pow_.inputs[0]
        axes = const_value(mean.inputs[1]) if len(mean.inputs) > 1 else mean.attrs.get("axes")
        if axes is None or list(axes.reshape(-1)) != [-1] or not mean.attrs.get("keepdims", 1):
            continue
        add = only_consumer(mean.outputs[0], "Add")
        if add is None:
            continue
        eps_t = other_operand(add, mean.outputs[0])
        if eps_t is None or not is_scalar(eps_t):
            continue
        sqrt = only_consumer(add.outputs[0], "Sqrt")
        recip = sqrt and only_consumer(sqrt.outputs[0], "Reciprocal")
        normed = recip and only_consumer(recip.outputs[0], "Mul")
        if normed is None or other_operand(normed, recip.outputs[0]) is not xf:
            continue
        tail = normed.outputs[0]
        cast_back = only_consumer(tail, "Cast")
        if cast_back is not None:
            tail = cast_back.outputs[0]
        scale_mul = only_consumer(tail, "Mul")
        if scale_mul is None:
            continue
        weight = other_operand(scale_mul, tail)
        # One scale per element of the normalised axis (the shape only: weights stay unread).
        if not isinstance(weight, gs.Constant) or len(weight.shape) != 1:
            continue
        width = xf.shape[-1] if xf.shape else None
        if isinstance(width, (int, np.integer)) and weight.shape[0] != width:
            continue
        x = _strip_cast(xf)
        out = scale_mul.outputs[0]
        out.inputs.clear()
        graph.nodes.append(
            gs.Node(
                "RMSNormalization",
                name=weight.name.removesuffix(".weight") or None,
                inputs=[x, weight],
                outputs=[out],
                attrs={
                    "axis": -1,
                    "epsilon": float(const_value(eps_t).reshape(())),
                    "stash_type": 1,
                },
            )
        )
        result.count(weight_layer(scale_mul))
    return result
