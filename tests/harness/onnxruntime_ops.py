"""Run a trtc ONNX graph in onnxruntime on CPU, with each plugin node executed by its torch
reference (through onnxruntime-extensions' Python custom ops). This checks the compiled graph
itself, not a re-implementation of it.

onnxruntime-extensions registers one type signature per op, so this path runs fp32 graphs
(the precision the golden checks use)."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from trtc.plugins.paged_attention import SPEC as PAGED_ATTENTION
from trtc.plugins.paged_attention.reference import paged_attention


@cache
def _register() -> str:
    from onnxruntime_extensions import PyCustomOpDef as T
    from onnxruntime_extensions import get_library_path, onnx_op

    attr_types = {int: T.dt_int64, float: T.dt_float}

    @onnx_op(
        op_type=PAGED_ATTENTION.qualified_name,
        inputs=[
            T.dt_float,
            T.dt_float,
            T.dt_float,
            T.dt_float,
            T.dt_int64,
            T.dt_int32,
            T.dt_int32,
            T.dt_int32,
        ],
        outputs=[T.dt_float, T.dt_float],
        attrs={k: attr_types[t] for k, t in PAGED_ATTENTION.attributes.items()},
    )
    def _paged_attention(
        query,
        key,
        value,
        kv_cache,
        slot_mapping,
        block_tables,
        context_lens,
        query_start_loc,
        **attrs,
    ):
        cache_t = torch.from_numpy(np.array(kv_cache, copy=True))
        out, cache_t = paged_attention(
            torch.from_numpy(query),
            torch.from_numpy(key),
            torch.from_numpy(value),
            cache_t,
            torch.from_numpy(slot_mapping),
            torch.from_numpy(block_tables),
            torch.from_numpy(context_lens),
            torch.from_numpy(query_start_loc),
            **attrs,
        )
        return out.numpy(), cache_t.numpy()

    return get_library_path()


def session(model_path: str):
    """An onnxruntime CPU session for a trtc graph (plugins run by their references)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.register_custom_ops_library(_register())
    options.log_severity_level = 3
    return ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
