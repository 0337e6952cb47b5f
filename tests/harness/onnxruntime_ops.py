"""Run a trtc ONNX graph in onnxruntime on CPU, with each plugin node executed by its torch
reference (through onnxruntime-extensions' Python custom ops). This checks the compiled graph
itself, not a re-implementation of it.

onnxruntime-extensions registers one type signature per op, so this path runs fp32 graphs
(the precision the golden checks use)."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from trtc.contract import STEP_INPUTS
from trtc.plugins.all_reduce import SPEC as ALL_REDUCE
from trtc.plugins.all_reduce import all_reduce
from trtc.plugins.paged_attention import SPEC as PAGED_ATTENTION
from trtc.plugins.paged_attention.reference import paged_attention


@cache
def _register() -> str:
    from onnxruntime_extensions import PyCustomOpDef as T
    from onnxruntime_extensions import get_library_path, onnx_op

    attr_types = {int: T.dt_int64, float: T.dt_float}
    index_types = {"int64": T.dt_int64, "int32": T.dt_int32}
    # The step inputs (slot mapping, block tables, ...) have their contract's dtype, the
    # activations and the cache are fp32; an input that an output aliases is updated in place.
    in_place = set(PAGED_ATTENTION.aliases.values())

    @onnx_op(
        op_type=PAGED_ATTENTION.qualified_name,
        inputs=[
            index_types[STEP_INPUTS[n][0]] if n in STEP_INPUTS else T.dt_float
            for n in PAGED_ATTENTION.inputs
        ],
        outputs=[T.dt_float] * len(PAGED_ATTENTION.outputs),
        attrs={k: attr_types[t] for k, t in PAGED_ATTENTION.attributes.items()},
    )
    def _paged_attention(*inputs, **attrs):
        tensors = [
            torch.from_numpy(np.array(x, copy=True) if n in in_place else x)
            for n, x in zip(PAGED_ATTENTION.inputs, inputs, strict=True)
        ]
        return tuple(t.numpy() for t in paged_attention(*tensors, **attrs))

    # One signature: the node without its optional bias (no tiny model has o_proj or
    # down_proj biases). Sums over the group this process joined.
    @onnx_op(
        op_type=ALL_REDUCE.qualified_name,
        inputs=[T.dt_float],
        outputs=[T.dt_float],
        attrs={k: attr_types[t] for k, t in ALL_REDUCE.attributes.items()},
    )
    def _all_reduce(x, **attrs):
        return all_reduce(torch.from_numpy(np.array(x, copy=True)), **attrs).numpy()

    return get_library_path()


def session(model_path: str):
    """An onnxruntime CPU session for a trtc graph (plugins run by their references)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.register_custom_ops_library(_register())
    options.log_severity_level = 3
    return ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
