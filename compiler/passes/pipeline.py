"""The pass pipeline: runs each pass in order over one onnx-graphsurgeon graph and collects
what each matched into the fusion report the manifest records."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext

import onnx
import onnx_graphsurgeon as gs

from trtc.compiler.families import ModelGeometry
from trtc.compiler.passes.attention import check_attention
from trtc.compiler.passes.base import PassResult
from trtc.compiler.passes.cleanup import cleanup
from trtc.compiler.passes.gemm import merge_sibling_gemms
from trtc.compiler.passes.precision import check_precision
from trtc.compiler.passes.rmsnorm import fuse_rmsnorm
from trtc.compiler.passes.rotary import fuse_rotary
from trtc.compiler.passes.swiglu import OPSET, fuse_swiglu, swiglu_function
from trtc.compiler.weight_recipes import LazyWeight, bind, recipes
from trtc.plugins.spec import DOMAIN

# Fusions every layer of a supported model must show; fewer is a build error. A model with
# per-head q/k norms (Qwen3) shows two more RMSNorms a layer (`expected_per_layer`).
EXPECTED_PER_LAYER = {
    "rmsnorm": 2,
    "rotary": 2,
    "qkv_gemm": 1,
    "gate_up_gemm": 1,
    "swiglu": 1,
    "paged_attention": 1,
}


def expected_per_layer(g: ModelGeometry) -> dict[str, int]:
    """The fusions every layer of ``g`` must show."""
    expected = dict(EXPECTED_PER_LAYER)
    if g.qk_norm:
        expected["rmsnorm"] += 2  # q_norm and k_norm, over each head
    return expected


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
        # Set by `run_passes` from the geometry, so the check needs nothing but the report.
        "expected_per_layer": {
            r.name: r.expected_per_layer for r in results if r.expected_per_layer is not None
        },
    }


def check_report(report: dict, num_layers: int) -> list[str]:
    """Layers whose fusions fall short of what the model must show (`expected_per_layer`)."""
    expected = report.get("expected_per_layer", {})
    unset = [name for name in EXPECTED_PER_LAYER if name not in expected]
    if unset:  # results that did not come through `run_passes`: nothing to hold them to
        return [f"no expected count for {', '.join(unset)} (run the passes with run_passes)"]
    problems = []
    for layer, counts in report["per_layer"].items():
        for name, want in expected.items():
            if counts.get(name, 0) != want:
                problems.append(
                    f"layer {layer}: {name} matched {counts.get(name, 0)}, expected {want}"
                )
    return problems


def run_passes(
    model: onnx.ModelProto,
    g: ModelGeometry,
    precision: str,
    stage=None,
    weights: Mapping[str, LazyWeight] | None = None,
):
    """Run the pipeline; ``stage(name)`` is a context manager (a progress display) yielding a
    dict whose ``detail`` each pass fills with what it matched. ``weights`` gives the
    placeholder initializers of an exported graph their recipes (`compiler.weights`): the
    passes then combine recipes, and no weight is read.

    Returns the rewritten graph, what each pass matched, and the recipes of the graph's
    placeholder initializers by id (what `writer.save_onnx` produces the weights from)."""
    stage = stage or (lambda name: nullcontext({}))
    # graphsurgeon warns that numpy has no bfloat16 when it imports a bf16 placeholder; its
    # values are never read here (recipes produce them), so the warning is noise.
    gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR
    graph = gs.import_onnx(model)
    if weights is not None:
        bind(graph, weights)
    results: list[PassResult] = []
    expected = expected_per_layer(g)
    for name, run in pass_list(g, precision):
        with stage(name) as done:
            res = run(graph)
            for r in res:
                r.expected_per_layer = expected.get(r.name)
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
    return out, results, recipes(graph)
