"""What a plugin is, as ONNX sees it: one description per plugin, shared by export, the
onnxruntime custom ops, the manifest and the TensorRT creators."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

DOMAIN = "trtc"


@dataclass(frozen=True)
class PluginSpec:
    """One plugin: its ONNX op type and version, input and output names in node order, the
    attributes with their types (and ``defaults`` for those a node may omit), the outputs that
    update an input in place, and its semantics in words (``doc``, recorded in the manifest)."""

    op_type: str
    version: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: dict[str, type]
    aliases: dict[str, str] = field(default_factory=dict)  # output -> input it updates in place
    doc: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)  # attributes a node may omit

    @property
    def qualified_name(self) -> str:
        return f"{DOMAIN}::{self.op_type}"

    def attribute_values(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every attribute from keyword arguments, in spec order: an omitted one taken from
        ``defaults`` and each converted to its declared type. A complete set (a graph node's,
        or values already normalised here) is returned as given, in the caller's order, at the
        cost of one key comparison: entry points call this on every eager call. Unknown or
        missing names raise TypeError, as they would in a call of a function that spelled the
        attributes out."""
        if given.keys() == self.attributes.keys():
            return dict(given)  # complete already (a graph node's, a normalised call's)
        unknown = sorted(set(given) - set(self.attributes))
        missing = [k for k in self.attributes if k not in given and k not in self.defaults]
        if unknown or missing:
            problems = [f"unknown {', '.join(unknown)}"] if unknown else []
            problems += [f"missing {', '.join(missing)}"] if missing else []
            raise TypeError(f"{self.qualified_name} attributes: {'; '.join(problems)}")
        return {
            k: t(given[k] if k in given else self.defaults[k]) for k, t in self.attributes.items()
        }

    def export(
        self,
        inputs: Sequence[torch.Tensor | None],
        attrs: Mapping[str, Any],
        *outputs: tuple[torch.dtype, Sequence[int]],
    ):
        """The plugin as one node of the ONNX graph being exported (``torch.onnx``): ``inputs``
        in spec order, an omitted optional one (None: a layer without bias) left out of the node;
        ``outputs`` the ``(dtype, shape)`` of each output. Returns the output tensor, or a tuple
        of them for a plugin with several outputs."""
        present = [t for t in inputs if t is not None]
        if len(outputs) == 1:
            ((dtype, shape),) = outputs
            op, kinds = torch.onnx.ops.symbolic, {"dtype": dtype, "shape": shape}
        else:
            dtypes, shapes = zip(*outputs)
            op, kinds = torch.onnx.ops.symbolic_multi_out, {"dtypes": dtypes, "shapes": shapes}
        return op(self.qualified_name, present, dict(attrs), version=self.version, **kinds)

    def to_manifest(self) -> dict:
        return {
            "domain": DOMAIN,
            "op_type": self.op_type,
            "version": self.version,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "attributes": {k: t.__name__ for k, t in self.attributes.items()},
            "aliases": dict(self.aliases),
            "semantics": self.doc,
        }


def gemm_spec(
    op_type: str, weights: tuple[str, ...], attributes: dict[str, type], doc: str
) -> PluginSpec:
    """A GEMM plugin: ``y [..., out_features] = x @ W.T + bias`` in x's dtype, ``W`` held as the
    ``weights`` tensors and described by ``attributes`` (``in_features`` and ``out_features``
    follow them), ``bias`` optional."""
    return PluginSpec(
        op_type=op_type,
        version=1,
        inputs=("x", *weights, "bias"),
        outputs=("y",),
        attributes={**attributes, "in_features": int, "out_features": int},
        doc=doc,
    )
