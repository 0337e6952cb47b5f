"""The pass pipeline: runs each pass in order over one onnx-graphsurgeon graph and collects
what each matched into the fusion report the manifest records."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import onnx
import onnx_graphsurgeon as gs

from trtc.compiler.architectures import ModelGeometry
from trtc.compiler.passes.attention import check_attention
from trtc.compiler.passes.base import PassResult
from trtc.compiler.passes.cleanup import cleanup
from trtc.compiler.passes.gemm import merge_sibling_gemms
from trtc.compiler.passes.precision import check_precision
from trtc.compiler.passes.rmsnorm import fuse_rmsnorm
from trtc.compiler.passes.rotary import fuse_rotary
from trtc.compiler.passes.swiglu import OPSET, fuse_swiglu, swiglu_function
from trtc.plugins.spec import DOMAIN

# Fusions every layer of a supported model must show; fewer is a build error.
EXPECTED_PER_LAYER = {
    "rmsnorm": 2,
    "rotary": 2,
    "qkv_gemm": 1,
    "gate_up_gemm": 1,
    "swiglu": 1,
    "paged_attention": 1,
}


def pass_list(
    g: ModelGeometry, precision: str
) -> list[tuple[str, Callable[[gs.Graph], list[PassResult]]]]:
    return [
        ("cleanup", lambda graph: [cleanup(graph)]),
        ("rmsnorm", lambda graph: [fuse_rmsnorm(graph)]),
        ("rotary", lambda graph: [fuse_rotary(graph)]),
        ("gemm", lambda graph: list(merge_sibling_gemms(graph))),
        ("swiglu", lambda graph: [fuse_swiglu(graph)]),
        ("attention", lambda graph: [check_attention(graph, g.num_layers)]),
        ("precision", lambda graph: [check_precision(graph, precision)]),
    ]


def fusion_report(results: list[PassResult], num_layers: int) -> dict:
    per_layer = {str(i): {} for i in range(num_layers)}
    final: dict[str, int] = {}
    totals = {}
    for r in results:
        if r.name in ("cleanup", "precision"):
            continue
        totals[r.name] = r.matched
        for layer, n in sorted(r.per_layer.items(), key=lambda kv: str(kv[0])):
            (final if layer == "final" else per_layer[str(layer)])[r.name] = n
    return {
        "totals": totals,
        "per_layer": per_layer,
        "final": final,
        "notes": {r.name: r.notes for r in results if r.notes},
    }


def check_report(report: dict, num_layers: int) -> list[str]:
    """Layers whose fusions fall short of what every supported model must show."""
    problems = []
    for layer, counts in report["per_layer"].items():
        for name, want in EXPECTED_PER_LAYER.items():
            if counts.get(name, 0) != want:
                problems.append(
                    f"layer {layer}: {name} matched {counts.get(name, 0)}, expected {want}"
                )
    return problems


def run_passes(model: onnx.ModelProto, g: ModelGeometry, precision: str, stage=None):
    """Run the pipeline; ``stage(name)`` is a context manager (a progress display) yielding a
    dict whose ``detail`` each pass fills with what it matched."""
    stage = stage or (lambda name: nullcontext({}))
    graph = gs.import_onnx(model)
    results: list[PassResult] = []
    for name, run in pass_list(g, precision):
        with stage(name) as done:
            res = run(graph)
            graph.cleanup(remove_unused_graph_inputs=False).toposort()
            done["detail"] = "; ".join(r.summary() for r in res)
        results.extend(res)
    out = gs.export_onnx(graph, do_type_check=True)
    out.ir_version = model.ir_version
    del out.opset_import[:]
    out.opset_import.extend(
        [onnx.helper.make_opsetid("", OPSET), onnx.helper.make_opsetid(DOMAIN, 1)]
    )
    if any(n.op_type == "SwiGLU" and n.domain == DOMAIN for n in out.graph.node):
        out.functions.append(swiglu_function())
    return out, results
