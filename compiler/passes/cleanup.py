"""Clean-up: constant folding (through onnxruntime, as onnx-graphsurgeon does it), shape
folding and dead-node removal."""

from __future__ import annotations

import contextlib
import io
import logging

import onnx_graphsurgeon as gs

from trtc.compiler.passes.base import PassResult


def cleanup(graph: gs.Graph) -> PassResult:
    before = len(graph.nodes)
    logging.getLogger("onnx_graphsurgeon").setLevel(logging.ERROR)
    gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR
    with contextlib.redirect_stdout(io.StringIO()):
        graph.fold_constants(fold_shapes=True, error_ok=False)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    # Constant nodes become initializers so later passes see weights as gs.Constant.
    for node in [n for n in graph.nodes if n.op == "Constant"]:
        out = node.outputs[0]
        const = gs.Constant(out.name + ".value", node.attrs["value"].values)
        for consumer in list(out.outputs):
            consumer.inputs[consumer.inputs.index(out)] = const
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    result = PassResult("cleanup")
    result.matched = before - len(graph.nodes)
    result.notes.append(f"{before} -> {len(graph.nodes)} nodes")
    return result
