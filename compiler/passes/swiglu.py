"""SwiGLU fusion: ``silu(gate) * up`` where gate and up are the halves of the merged gate-up
GEMM becomes one ``trtc::SwiGLU`` node on the GEMM output ``[T, 2I] -> [T, I]`` (the
vLLM ``SiluAndMul`` shape, one pass over memory). The node ships as an ONNX model-local
function, so onnxruntime and the TensorRT parsers inline its body where no kernel is registered."""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from trtc.compiler.passes.base import PassResult, const_value, other_operand, producer, weight_layer
from trtc.plugins.spec import DOMAIN

OPSET = 23


def swiglu_function() -> onnx.FunctionProto:
    return helper.make_function(
        DOMAIN,
        "SwiGLU",
        ["gate_up"],
        ["out"],
        [
            helper.make_node("Split", ["gate_up"], ["gate", "up"], axis=-1, num_outputs=2),
            helper.make_node("Sigmoid", ["gate"], ["sig"]),
            helper.make_node("Mul", ["gate", "sig"], ["silu"]),
            helper.make_node("Mul", ["silu", "up"], ["out"]),
        ],
        opset_imports=[helper.make_opsetid("", OPSET)],
        doc_string="silu(gate_up[..., :I]) * gate_up[..., I:]",
    )


def fuse_swiglu(graph: gs.Graph) -> PassResult:
    result = PassResult("swiglu")
    for sig in [n for n in graph.nodes if n.op == "Sigmoid"]:
        gate = sig.inputs[0]
        silu = next(
            (
                c
                for c in sig.outputs[0].outputs
                if c.op == "Mul" and other_operand(c, sig.outputs[0]) is gate
            ),
            None,
        )
        if silu is None or len(silu.outputs[0].outputs) != 1:
            continue
        mul = silu.outputs[0].outputs[0]
        up = other_operand(mul, silu.outputs[0]) if mul.op == "Mul" else None
        split = producer(gate, "Split")
        if up is None or split is None or producer(up) is not split or split.outputs != [gate, up]:
            continue
        sizes = const_value(split.inputs[1]) if len(split.inputs) > 1 else None
        if sizes is None or len(set(sizes.tolist())) != 1:
            continue
        gate_up = split.inputs[0]
        out = mul.outputs[0]
        out.inputs.clear()
        graph.nodes.append(
            gs.Node(
                "SwiGLU",
                domain=DOMAIN,
                name=gate_up.name.removesuffix(".out") + ".swiglu",
                inputs=[gate_up],
                outputs=[out],
            )
        )
        result.count(weight_layer(producer(gate_up)) if producer(gate_up) else "final")
    return result
