"""GEMM fusion: sibling projections that read the same activation (q/k/v, gate/up) become one
GEMM over concatenated weights (and biases) followed by a Split, so each layer reads its
activations once and launches one GEMM per group, as vLLM's merged QKV and gate-up layers do.
Bias stays inside the GEMM node (GEMM+bias in one op). Quantized projections merge the same
way: `trtc::Int4Gemm` and `trtc::Fp8Gemm` keep every per-output-channel tensor along N, so
their packed weights, scales, zeros and biases concatenate along N too."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from trtc.compiler import weight_recipes
from trtc.compiler.passes.base import PassResult, weight_layer, weight_values
from trtc.plugins.spec import DOMAIN

GROUPS = {  # group name -> projection names, in output order
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "gate_up": ("gate_proj", "up_proj"),
}
# Per-output-channel inputs of the quantized GEMMs, (position, name): concatenated along N.
CHANNEL_INPUTS = {
    "Int4Gemm": ((1, "qweight"), (2, "scales"), (3, "zeros")),
    "Fp8Gemm": ((1, "weight"), (2, "weight_scale")),
}


def _kind(node: gs.Node) -> str | None:
    """'Gemm', 'Int4Gemm' or 'Fp8Gemm' for a mergeable projection node, else None."""
    if node.op == "Gemm" and not node.domain:
        a = node.attrs
        plain = (
            not a.get("transA", 0)
            and a.get("transB", 0) == 1
            and a.get("alpha", 1.0) == 1.0
            and a.get("beta", 1.0) == 1.0
        )
        return (
            "Gemm" if plain and all(isinstance(t, gs.Constant) for t in node.inputs[1:]) else None
        )
    if node.domain == DOMAIN and node.op in ("Int4Gemm", "Fp8Gemm"):
        return node.op if all(isinstance(t, gs.Constant) for t in node.inputs[1:]) else None
    return None


def _projection(node: gs.Node) -> str:
    name = node.inputs[1].name
    return name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name


def _out_features(node: gs.Node) -> int:
    return node.inputs[1].shape[0]


def _bias(node: gs.Node, position: int, n: int, dtype):
    if len(node.inputs) > position:
        return weight_values(node.inputs[position])
    return np.zeros(n, dtype)


def _merged_inputs(
    kind: str, nodes: list[gs.Node], prefix: str, group: str
) -> list[gs.Constant] | None:
    """The constant inputs of the merged node, or None when the siblings do not merge."""
    name = f"{prefix}.{group}_proj"
    sizes = [_out_features(n) for n in nodes]
    if kind == "Gemm":
        tensors, bias_at = [n.inputs[1] for n in nodes], 2
        if len({w.dtype for w in tensors}) != 1 or len({w.shape[1] for w in tensors}) != 1:
            return None
        merged = [
            gs.Constant(
                f"{name}.weight", weight_recipes.concat([weight_values(w) for w in tensors])
            )
        ]
    else:
        if kind == "Int4Gemm" and (
            len({n.attrs["group_size"] for n in nodes}) != 1
            or len({n.attrs["in_features"] for n in nodes}) != 1
        ):
            return None
        bias_at = 4
        merged = [
            gs.Constant(
                f"{name}.{part}", weight_recipes.concat([weight_values(n.inputs[i]) for n in nodes])
            )
            for i, part in CHANNEL_INPUTS[kind]
        ]
    if kind == "Fp8Gemm":  # one static input scale per node; siblings read one input, so equal
        merged.append(
            gs.Constant(
                f"{name}.input_scale",
                weight_recipes.maximum([weight_values(n.inputs[3]) for n in nodes]),
            )
        )
    if any(len(n.inputs) > bias_at for n in nodes):
        dtype = next(n.inputs[bias_at].dtype for n in nodes if len(n.inputs) > bias_at)
        merged.append(
            gs.Constant(
                f"{name}.bias",
                weight_recipes.concat([_bias(n, bias_at, s, dtype) for n, s in zip(nodes, sizes)]),
            )
        )
    return merged


def merge_sibling_gemms(graph: gs.Graph) -> tuple[PassResult, PassResult]:
    merged = {g: PassResult(f"{g}_gemm") for g in GROUPS}
    for tensor in list(graph.tensors().values()):
        projections = {}
        for node in tensor.outputs:
            kind = _kind(node)
            if kind and node.inputs[0] is tensor:
                projections[_projection(node)] = (kind, node)
        for group, members in GROUPS.items():
            if not all(m in projections for m in members):
                continue
            kinds = {projections[m][0] for m in members}
            if len(kinds) != 1:
                continue
            kind = kinds.pop()
            nodes = [projections[m][1] for m in members]
            prefix = nodes[0].inputs[1].name.rsplit(".", 2)[0]
            constants = _merged_inputs(kind, nodes, prefix, group)
            if constants is None:
                continue
            sizes = [_out_features(n) for n in nodes]
            fused = gs.Variable(f"{prefix}.{group}_proj.out", dtype=nodes[0].outputs[0].dtype)
            outs = [n.outputs[0] for n in nodes]
            for o in outs:
                o.inputs.clear()
            attrs = (
                {"transB": 1} if kind == "Gemm" else {**nodes[0].attrs, "out_features": sum(sizes)}
            )
            graph.nodes += [
                gs.Node(
                    kind,
                    name=f"{prefix}.{group}_proj",
                    inputs=[tensor, *constants],
                    outputs=[fused],
                    attrs=attrs,
                    domain=None if kind == "Gemm" else DOMAIN,
                ),
                gs.Node(
                    "Split",
                    name=f"{prefix}.{group}_split",
                    inputs=[
                        fused,
                        gs.Constant(f"{prefix}.{group}_proj.sizes", np.array(sizes, np.int64)),
                    ],
                    outputs=outs,
                    attrs={"axis": -1},
                ),
            ]
            merged[group].count(weight_layer(nodes[0]))
    return merged["qkv"], merged["gate_up"]
