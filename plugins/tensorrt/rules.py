"""What trtc's TensorRT plugins say about themselves, as plain functions of their specs
(`trtc.plugins.spec`, one per plugin package): which fields they take, which tensor types, and
the shapes and types of their outputs. `plugin.py` translates these answers into TensorRT's
objects (``PluginField``, ``DataType``, ``IDimensionExpr``); the tests check them against the
reference ops on real tensors, where no TensorRT builder is needed.

Dtypes are named as in the manifest (``fp32``, ``fp16``, ``bf16``, ``fp8``, ``int64``, ...).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any, TypeVar

import numpy as np
import torch

from trtc import contract
from trtc.plugins import PLUGINS
from trtc.plugins.spec import PluginSpec

D = TypeVar("D")  # a dimension: an int here, a TensorRT IDimensionExpr in get_output_shapes

FLOATS = ("fp32", "fp16", "bf16")

# The dtypes each input may have: a tuple of names, or the name of an earlier input whose dtype
# it shares. Keyed by the specs' own input names (checked below).
INPUT_DTYPES: dict[str, dict[str, tuple[str, ...] | str]] = {
    "PagedAttention": {
        "query": FLOATS,
        "key": "query",
        "value": "query",
        "kv_cache": FLOATS + ("fp8",),
        "slot_mapping": ("int64",),
        "block_tables": ("int32",),
        "context_lens": ("int32",),
        "query_start_loc": ("int32",),
    },
    "Int4Gemm": {
        "x": FLOATS,
        "qweight": ("uint8",),
        "scales": "x",
        "zeros": ("uint8",),
        "bias": "x",
    },
    "Fp8Gemm": {
        "x": FLOATS,
        "weight": ("fp8",),
        "weight_scale": ("fp32",),
        "input_scale": ("fp32",),
        "bias": "x",
    },
    "AllReduce": {"x": FLOATS, "bias": "x"},
}
# Each output takes the dtype of this input.
OUTPUT_DTYPES: dict[str, dict[str, str]] = {
    "PagedAttention": {"attn_out": "query", "kv_cache_out": "kv_cache"},
    "Int4Gemm": {"y": "x"},
    "Fp8Gemm": {"y": "x"},
    "AllReduce": {"y": "x"},
}
# TensorRT plugins take no uint8 tensors (PluginTensorDesc: "kBOOL and kUINT8 are not supported"):
# the TensorRT graph carries them as int8, the same bytes, and the plugin views them as uint8 again.
CARRIED_AS = {"uint8": "int8"}
NON_NEGATIVE = {"sliding_window"}  # 0 = no window; every other number must be positive
FIELD_TYPES = {
    int: ("INT32", np.int32),
    float: ("FLOAT32", np.float32),
}  # PluginFieldType member, array dtype

TORCH_DTYPES = {  # the contract's float names, and the integer tensors plugins take
    **contract.TORCH_DTYPES,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
TRT_DTYPE_NAMES = {
    "FLOAT": "fp32",
    "HALF": "fp16",
    "BF16": "bf16",
    "FP8": "fp8",
    "INT64": "int64",
    "INT32": "int32",
    "INT8": "int8",
    "UINT8": "uint8",
    "BOOL": "bool",
}

for _op, _spec in PLUGINS.items():  # the tables above name exactly the specs' tensors
    assert (
        tuple(INPUT_DTYPES[_op]) == _spec.inputs and tuple(OUTPUT_DTYPES[_op]) == _spec.outputs
    ), _op


class PluginFieldError(ValueError):
    """Fields that do not make a plugin: which one, and what was expected."""


def spec_of(op_type: str) -> PluginSpec:
    return PLUGINS[op_type]


def entry_point(spec: PluginSpec) -> Callable:
    """The plugin's torch entry point, ``trtc.plugins.<snake>.<snake>`` (``Int4Gemm`` ->
    ``int4_gemm``): the Triton/CUDA implementation on CUDA tensors, the reference on CPU."""
    return _entry_point(spec.op_type)


@cache
def _entry_point(op_type: str) -> Callable:
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", op_type).lower()
    return getattr(importlib.import_module(f"trtc.plugins.{snake}"), snake)


def _parameters(spec: PluginSpec) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(entry_point(spec)).parameters


def field_defaults(spec: PluginSpec) -> dict[str, Any]:
    """Attributes a node may omit, with their values (`PluginSpec.defaults`: a node exported
    before they existed lacks them)."""
    return dict(spec.defaults)


def num_required_inputs(spec: PluginSpec) -> int:
    """Inputs before the first optional one (``bias=None``): a node may omit the optional tail."""
    params = _parameters(spec)
    optional = [n for n in spec.inputs if params[n].default is not inspect.Parameter.empty]
    return spec.inputs.index(optional[0]) if optional else len(spec.inputs)


def parse_fields(spec: PluginSpec, fields: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """Attributes from plugin fields ``{name: (PluginFieldType member name, data)}``; every
    problem is a `PluginFieldError` that names the plugin, the field and what was expected."""
    who = spec.qualified_name
    unknown = sorted(set(fields) - set(spec.attributes))
    if unknown:
        raise PluginFieldError(
            f"{who}: unknown field(s) {', '.join(unknown)} (fields: {', '.join(spec.attributes)})"
        )
    defaults = field_defaults(spec)
    attrs: dict[str, Any] = {}
    for name, kind in spec.attributes.items():
        if name not in fields:
            if name not in defaults:
                raise PluginFieldError(
                    f"{who}: field {name} is missing (fields: {', '.join(spec.attributes)})"
                )
            attrs[name] = kind(defaults[name])
            continue
        type_name, data = fields[name]
        want = FIELD_TYPES[kind][0]
        if type_name != want:
            raise PluginFieldError(f"{who}: field {name} is {type_name}, expected {want}")
        values = np.asarray(data).reshape(-1)
        if values.size != 1:
            raise PluginFieldError(f"{who}: field {name} holds {values.size} values, expected one")
        attrs[name] = kind(values[0])
    check_attributes(spec, attrs)
    return attrs


def check_attributes(spec: PluginSpec, attrs: Mapping[str, Any]) -> None:
    who = spec.qualified_name
    for name, value in attrs.items():
        if not math.isfinite(value) or value < 0 or (value == 0 and name not in NON_NEGATIVE):
            raise PluginFieldError(
                f"{who}: field {name} is {value}, expected a "
                f"{'non-negative' if name in NON_NEGATIVE else 'positive'} number"
            )
    if spec.op_type == "PagedAttention" and attrs["num_heads"] % attrs["num_kv_heads"]:
        raise PluginFieldError(
            f"{who}: num_heads {attrs['num_heads']} is not a multiple of "
            f"num_kv_heads {attrs['num_kv_heads']}"
        )
    if spec.op_type == "Int4Gemm" and attrs["in_features"] % 2:
        raise PluginFieldError(
            f"{who}: in_features {attrs['in_features']} is odd (two 4-bit weights share a byte)"
        )


def field_values(
    spec: PluginSpec, attrs: Mapping[str, Any] | None = None
) -> list[tuple[str, np.ndarray, str]]:
    """``(name, array, PluginFieldType member name)`` per attribute in spec order: one value each
    from ``attrs``, or empty arrays (a creator's field list) when ``attrs`` is None."""
    out = []
    for name, kind in spec.attributes.items():
        type_name, dtype = FIELD_TYPES[kind]
        out.append((name, np.array([] if attrs is None else [attrs[name]], dtype=dtype), type_name))
    return out


def fields_from_attributes(
    spec: PluginSpec, attrs: Mapping[str, Any]
) -> dict[str, tuple[str, Any]]:
    """Fields as the ONNX parser hands a node's attributes over: each converted to the type the
    creator declares for it (names the spec does not know are kept, typed UNKNOWN)."""
    return {
        name: (
            FIELD_TYPES[spec.attributes[name]][0] if name in spec.attributes else "UNKNOWN",
            value,
        )
        for name, value in attrs.items()
    }


def output_dtypes(spec: PluginSpec, input_dtypes: Sequence[D]) -> list[D]:
    """Output dtypes as the input dtypes they copy (works for names, torch or TensorRT dtypes)."""
    return [input_dtypes[spec.inputs.index(src)] for src in OUTPUT_DTYPES[spec.op_type].values()]


def output_shapes(
    spec: PluginSpec,
    attrs: Mapping[str, Any],
    input_shapes: Sequence[Sequence[D]],
    constant: Callable[[int], D] = int,
) -> list[list[D]]:
    """Output shapes from the input shapes: each dimension is an input's dimension or a
    ``constant(attribute)``, so the same rule runs on ints and on TensorRT expressions."""
    shape = {name: list(s) for name, s in zip(spec.inputs, input_shapes)}
    if spec.op_type == "PagedAttention":
        return [shape["query"], shape["kv_cache"]]
    if spec.op_type in ("Int4Gemm", "Fp8Gemm"):
        return [shape["x"][:-1] + [constant(attrs["out_features"])]]
    raise KeyError(f"no output shape rule for {spec.qualified_name}")


def aliased_input(spec: PluginSpec, output_index: int) -> int:
    """Index of the input that output ``output_index`` updates in place, or -1."""
    src = spec.aliases.get(spec.outputs[output_index])
    return spec.inputs.index(src) if src else -1


def allowed_input_dtypes(
    spec: PluginSpec, index: int, input_dtypes: Sequence[str]
) -> tuple[str, ...]:
    """The dtypes (op-side names) input ``index`` may have given the earlier inputs' dtypes."""
    rule = INPUT_DTYPES[spec.op_type][spec.inputs[index]]
    return (input_dtypes[spec.inputs.index(rule)],) if isinstance(rule, str) else rule


def trt_side(dtype: str) -> str:
    """The dtype TensorRT sees for an op-side dtype (uint8 travels as int8)."""
    return CARRIED_AS.get(dtype, dtype)


def op_side(spec: PluginSpec, index: int, trt_dtype: str) -> str:
    """The dtype the op reads input ``index`` as, given the dtype TensorRT gives it."""
    declared = INPUT_DTYPES[spec.op_type][spec.inputs[index]]
    if isinstance(declared, tuple):
        for d in declared:
            if trt_side(d) == trt_dtype:
                return d
    return trt_dtype


def supports(spec: PluginSpec, pos: int, num_inputs: int, trt_dtypes: Sequence[str]) -> bool:
    """TensorRT's format question for position ``pos`` (inputs, then outputs), given the
    TensorRT-side dtypes of positions ``0..pos`` (later ones are undefined when it asks)."""
    if not num_required_inputs(spec) <= num_inputs <= len(spec.inputs):
        return False
    op = [op_side(spec, i, d) for i, d in enumerate(trt_dtypes[: min(pos + 1, num_inputs)])]
    if pos < num_inputs:
        return (
            op[pos] in allowed_input_dtypes(spec, pos, op) and trt_side(op[pos]) == trt_dtypes[pos]
        )
    want = output_dtypes(
        spec, [trt_dtypes[i] for i in range(num_inputs)] + [None] * (len(spec.inputs) - num_inputs)
    )
    return trt_dtypes[pos] == want[pos - num_inputs]
