"""trtc's custom ops as Python ``IPluginV3`` plugins for full TensorRT, registered under the plugin
namespace ``trtc`` so the ONNX parser maps the graph's ``trtc`` domain nodes to them (it looks a
node up by op type, ``plugin_version`` and ``plugin_namespace``/domain).

Written against a TensorRT module passed in: ``tensorrt`` in a build or a serving process;
``tensorrt_rtx`` exposes the same Python classes (and the tests construct them with it), but
TensorRT-RTX runs no custom plugins. Everything a plugin decides comes from `rules.py`;
``enqueue`` wraps TensorRT's device pointers as torch tensors and calls the plugin's torch entry
point (Triton kernels on CUDA tensors) on TensorRT's stream.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import torch

from trtc.plugins import PLUGINS
from trtc.plugins.spec import DOMAIN, PluginSpec
from trtc.plugins.tensorrt import rules

_registered: dict[
    tuple[int, str], Any
] = {}  # (id of the TensorRT module, op type) -> creator, kept alive


class _DeviceBytes:
    """``nbytes`` of device memory at ``ptr``, as torch can adopt it (__cuda_array_interface__)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (int(ptr), False),
            "version": 3,
            "strides": None,
        }


def device_tensor(ptr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A torch view of TensorRT-owned device memory (bytes first: bf16 and fp8 have no typestr)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device="cuda")
    raw = torch.as_tensor(_DeviceBytes(ptr, nbytes), device="cuda")
    return raw.view(dtype).view(shape)


def run_plugin(
    spec: PluginSpec, attrs: dict, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
) -> None:
    """One plugin call on tensors: the entry point's results go into ``outputs``; an output that
    aliases its input (the KV cache) was written in place and is only copied if TensorRT gave it
    its own buffer."""
    results = rules.entry_point(spec)(**dict(zip(spec.inputs, inputs)), **attrs)
    results = results if isinstance(results, tuple) else (results,)
    for dst, src in zip(outputs, results):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)


def _field_dict(trt, fc) -> dict[str, tuple[str, Any]]:
    names = {v: k for k, v in trt.PluginFieldType.__members__.items()}
    return {f.name: (names.get(f.type, str(f.type)), f.data) for f in fc}


def _plugin_fields(trt, values) -> list:
    """``trt.PluginField`` objects of ``(name, data, kind)`` values (`rules.field_values`)."""
    return [
        trt.PluginField(name, data, getattr(trt.PluginFieldType, kind))
        for name, data, kind in values
    ]


def _dtype_name(trt_dtype) -> str:
    return rules.TRT_DTYPE_NAMES.get(trt_dtype.name, trt_dtype.name)


class _PluginCalls:
    """A trtc plugin's answers to TensorRT's ``IPluginV3`` core, build and runtime calls, each
    from `rules` for the `PluginSpec` it implements. `plugin_classes` mixes it with one
    TensorRT module's interfaces; ``trt`` is that module."""

    trt: Any

    def __init__(self, spec: PluginSpec, attrs: dict, phase=None):
        trt = self.trt
        trt.IPluginV3.__init__(self)
        trt.IPluginV3OneCore.__init__(self)
        trt.IPluginV3OneBuildV2.__init__(self)
        trt.IPluginV3OneRuntime.__init__(self)
        self.spec, self.attrs, self.phase = spec, dict(attrs), phase
        self.plugin_name = spec.op_type
        self.plugin_version = str(spec.version)
        self.plugin_namespace = DOMAIN
        self.num_outputs = len(spec.outputs)
        described = ",".join(f"{k}={v}" for k, v in self.attrs.items())
        self.metadata_string = f"{spec.qualified_name}({described})"
        self.timing_cache_id = self.metadata_string  # same attributes, same timings
        self._serialized = None

    # --- core -----------------------------------------------------------------------------
    def get_capability_interface(self, capability_type):
        return self

    def clone(self):
        return type(self)(self.spec, self.attrs, self.phase)

    def destroy(self):
        pass

    # --- build ----------------------------------------------------------------------------
    def configure_plugin(self, inp, out):
        n = len(inp)
        if not rules.num_required_inputs(self.spec) <= n <= len(self.spec.inputs):
            raise ValueError(
                f"{self.spec.qualified_name}: {n} inputs, expected {', '.join(self.spec.inputs)}"
            )

    def get_output_data_types(self, input_types):
        return rules.output_dtypes(self.spec, list(input_types))

    def get_output_shapes(self, inputs, shape_inputs, expr_builder):
        shapes = [[d[i] for i in range(len(d))] for d in inputs]
        return [
            self.trt.DimsExprs(s)
            for s in rules.output_shapes(self.spec, self.attrs, shapes, expr_builder.constant)
        ]

    def supports_format_combination(self, pos, in_out, num_inputs):
        if in_out[pos].desc.format != self.trt.TensorFormat.LINEAR:
            return False
        dtypes = [_dtype_name(in_out[i].desc.type) for i in range(pos + 1)]
        return rules.supports(self.spec, pos, num_inputs, dtypes)

    def get_aliased_input(self, output_index):
        return rules.aliased_input(self.spec, output_index)

    def get_valid_tactics(self):
        return []

    def get_workspace_size(self, inp, out):
        return 0

    # --- runtime --------------------------------------------------------------------------
    def get_fields_to_serialize(self):
        # The arrays stay referenced by the plugin: the collection only points at them.
        self._serialized = _plugin_fields(self.trt, rules.field_values(self.spec, self.attrs))
        return self.trt.PluginFieldCollection(self._serialized)

    def on_shape_change(self, inp, out):
        pass  # nothing is precomputed per shape: enqueue reads its descriptors

    def set_tactic(self, tactic):
        pass

    def attach_to_context(self, resource_context):
        return self.clone()

    def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
        ins = [
            device_tensor(
                ptr,
                tuple(d.dims),
                rules.TORCH_DTYPES[rules.op_side(self.spec, i, _dtype_name(d.type))],
            )
            for i, (d, ptr) in enumerate(zip(input_desc, inputs))
        ]
        outs = [
            device_tensor(ptr, tuple(d.dims), rules.TORCH_DTYPES[_dtype_name(d.type)])
            for d, ptr in zip(output_desc, outputs)
        ]
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            run_plugin(self.spec, self.attrs, ins, outs)


class _CreatorCalls:
    """A plugin creator's answers to TensorRT's ``IPluginCreatorV3One`` calls: the fields a
    `PluginSpec` takes, and a plugin (``plugin_class``) made from them. `plugin_classes` mixes
    it with one TensorRT module's interface; ``trt`` is that module."""

    trt: Any
    plugin_class: type

    def __init__(self, spec: PluginSpec):
        self.trt.IPluginCreatorV3One.__init__(self)
        self.spec = spec
        self.name = spec.op_type
        self.plugin_version = str(spec.version)
        self.plugin_namespace = DOMAIN
        self._fields = _plugin_fields(self.trt, rules.field_values(spec))
        self.field_names = self.trt.PluginFieldCollection(self._fields)

    def create_plugin(self, name, field_collection, phase):
        fields = _field_dict(self.trt, field_collection)
        return self.plugin_class(self.spec, rules.parse_fields(self.spec, fields), phase)


@cache
def plugin_classes(trt) -> tuple[type, type]:
    """``(Plugin, Creator)`` for one TensorRT module; both take the `PluginSpec` they implement."""

    class Plugin(
        _PluginCalls,
        trt.IPluginV3,
        trt.IPluginV3OneCore,
        trt.IPluginV3OneBuildV2,
        trt.IPluginV3OneRuntime,
    ):
        pass

    class Creator(_CreatorCalls, trt.IPluginCreatorV3One):
        plugin_class = Plugin

    Plugin.trt = Creator.trt = trt
    return Plugin, Creator


def create_plugin(trt, op_type: str, attrs: dict, phase=None):
    """A plugin object straight from attributes (checked as fields would be)."""
    plugin_cls, _ = plugin_classes(trt)
    spec = PLUGINS[op_type]
    return plugin_cls(
        spec, rules.parse_fields(spec, rules.fields_from_attributes(spec, attrs)), phase
    )


def register_plugins(trt) -> list:
    """Register a creator per plugin with ``trt``'s plugin registry (once per module)."""
    _, creator_cls = plugin_classes(trt)
    registry = trt.get_plugin_registry()
    for op_type, spec in PLUGINS.items():
        key = (id(trt), op_type)
        if key in _registered:
            continue
        creator = creator_cls(spec)
        if not registry.register_creator(creator, DOMAIN):
            raise RuntimeError(
                f"TensorRT refused to register the {spec.qualified_name} plugin creator"
            )
        _registered[key] = creator
    return [c for (mod, _), c in _registered.items() if mod == id(trt)]


def deregister_plugins(trt) -> None:
    registry = trt.get_plugin_registry()
    for key in [k for k in _registered if k[0] == id(trt)]:
        registry.deregister_creator(_registered.pop(key))
