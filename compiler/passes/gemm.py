"""GEMM fusion: sibling projections that read the same activation (q/k/v, gate/up) become one
GEMM over concatenated weights (and biases) followed by a Split, so each layer reads its
activations once and launches one GEMM per group, as vLLM's merged QKV and gate-up layers do.
Bias stays inside the Gemm node (GEMM+bias in one op)."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from trtc.compiler.passes.base import PassResult, weight_layer

GROUPS = {  # group name -> projection names, in output order
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "gate_up": ("gate_proj", "up_proj"),
}


def _plain_gemm(node: gs.Node) -> bool:
    a = node.attrs
    return (node.op == "Gemm" and not a.get("transA", 0) and a.get("transB", 0) == 1
            and a.get("alpha", 1.0) == 1.0 and a.get("beta", 1.0) == 1.0
            and isinstance(node.inputs[1], gs.Constant)
            and (len(node.inputs) < 3 or isinstance(node.inputs[2], gs.Constant)))


def _projection(node: gs.Node) -> str:
    name = node.inputs[1].name
    return name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name


def merge_sibling_gemms(graph: gs.Graph) -> tuple[PassResult, PassResult]:
    merged = {g: PassResult(f"{g}_gemm") for g in GROUPS}
    for tensor in list(graph.tensors().values()):
        gemms = {_projection(n): n for n in tensor.outputs if _plain_gemm(n)}
        for group, members in GROUPS.items():
            if not all(m in gemms for m in members):
                continue
            nodes = [gemms[m] for m in members]
            weights = [n.inputs[1].values for n in nodes]
            if len({w.dtype for w in weights}) != 1 or len({w.shape[1] for w in weights}) != 1:
                continue
            sizes = [w.shape[0] for w in weights]
            prefix = nodes[0].inputs[1].name.rsplit(".", 2)[0]
            inputs = [tensor, gs.Constant(f"{prefix}.{group}_proj.weight", np.concatenate(weights, 0))]
            if any(len(n.inputs) > 2 for n in nodes):
                biases = [n.inputs[2].values if len(n.inputs) > 2 else np.zeros(s, weights[0].dtype)
                          for n, s in zip(nodes, sizes)]
                inputs.append(gs.Constant(f"{prefix}.{group}_proj.bias", np.concatenate(biases, 0)))
            fused = gs.Variable(f"{prefix}.{group}_proj.out", dtype=nodes[0].outputs[0].dtype)
            outs = [n.outputs[0] for n in nodes]
            for o in outs:
                o.inputs.clear()
            graph.nodes += [
                gs.Node("Gemm", name=f"{prefix}.{group}_proj", inputs=inputs, outputs=[fused],
                        attrs={"transB": 1}),
                gs.Node("Split", name=f"{prefix}.{group}_split",
                        inputs=[fused, gs.Constant(f"{prefix}.{group}_proj.sizes", np.array(sizes, np.int64))],
                        outputs=outs, attrs={"axis": -1}),
            ]
            merged[group].count(weight_layer(nodes[0]))
    return merged["qkv"], merged["gate_up"]
