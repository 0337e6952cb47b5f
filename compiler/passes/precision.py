"""Precision check: the graph is strongly typed (as TensorRT 11 and TensorRT-RTX require), so
every floating-point weight must already be in the build precision; the only fp32 math is what
is meant to be fp32 (RMSNorm statistics via stash_type, attention softmax inside the plugin,
the logits)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from trtc.compiler.passes.base import PassResult
from trtc.errors import BuildError

NUMPY_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _is_float(dtype) -> bool:
    return dtype.kind == "f" or dtype.name == "bfloat16"


def _fp32_by_contract(graph: gs.Graph) -> set[str]:
    """Inputs a plugin defines as fp32 whatever the model precision (`trtc::Fp8Gemm`'s scales)."""
    return {n.inputs[i].name for n in graph.nodes if n.op == "Fp8Gemm" for i in (2, 3)}


def check_precision(graph: gs.Graph, precision: str) -> PassResult:
    result = PassResult("precision")
    want = NUMPY_NAMES[precision]
    wrong = []
    exempt = _fp32_by_contract(graph)
    for t in graph.tensors().values():
        # Shape and dtype only: reading .values would materialise checkpoint weights.
        if not isinstance(t, gs.Constant) or not _is_float(np.dtype(t.dtype)):
            continue
        if int(np.prod(t.shape, dtype=np.int64)) <= 1:
            continue  # scalars (eps, exponents) are typed by the ops that read them
        if t.name in exempt:
            continue
        if np.dtype(t.dtype).name != want:
            wrong.append(f"{t.name} ({np.dtype(t.dtype).name})")
        result.matched += 1
    if wrong:
        raise BuildError(f"{len(wrong)} weight(s) are not {precision}: {', '.join(wrong[:3])}")
    result.notes.append(f"{result.matched} weight tensors, all {precision}")
    return result
