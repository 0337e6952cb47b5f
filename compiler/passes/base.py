"""What every graph pass shares: the result it reports and small graph-walking helpers."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from trtc.compiler.weight_recipes import LazyWeight

LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass
class PassResult:
    name: str
    matched: int = 0
    per_layer: Counter = field(default_factory=Counter)  # layer index (or "final") -> count
    notes: list[str] = field(default_factory=list)
    # What every layer must show, set by the pipeline from the model's geometry (None: a pass
    # whose count is not checked per layer).
    expected_per_layer: int | None = None

    def count(self, layer) -> None:
        self.matched += 1
        self.per_layer[layer] += 1

    def summary(self) -> str:
        text = f"{self.name}: {self.matched} matched"
        return text + (f" ({'; '.join(self.notes)})" if self.notes else "")


def producer(tensor: gs.Tensor, op: str | None = None) -> gs.Node | None:
    """The node that produces ``tensor`` (if it is an ``op`` node when ``op`` is given)."""
    if not tensor.inputs:
        return None
    node = tensor.inputs[0]
    return node if op is None or node.op == op else None


def only_consumer(tensor: gs.Tensor, op: str | None = None) -> gs.Node | None:
    if len(tensor.outputs) != 1:
        return None
    node = tensor.outputs[0]
    return node if op is None or node.op == op else None


def const_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The values of a structural constant (a shape, an axis, an exponent); None for a
    variable and for a checkpoint weight, which never decides a pattern and stays unread."""
    if isinstance(tensor, gs.Constant):
        return None if isinstance(tensor._values, LazyWeight) else tensor.values
    node = producer(tensor, "Constant")
    if node is not None:
        return node.attrs["value"].values
    return None


def weight_values(tensor: gs.Constant) -> np.ndarray | LazyWeight:
    """A constant's values for a pass that combines weights: a checkpoint weight stays a
    recipe (see `compiler.weights`), anything else is read."""
    return tensor._values if isinstance(tensor._values, LazyWeight) else tensor.values


def is_scalar(tensor: gs.Tensor, value: float | None = None) -> bool:
    v = const_value(tensor)
    if v is None or v.size != 1:
        return False
    return value is None or float(v.reshape(())) == value


def layer_of(name: str):
    m = LAYER_RE.search(name)
    return int(m.group(1)) if m else "final"


def weight_layer(node: gs.Node):
    """Layer index of the first named constant a node reads (weights carry HF names)."""
    for t in node.inputs:
        if isinstance(t, gs.Constant) and LAYER_RE.search(t.name):
            return layer_of(t.name)
    return "final"


def other_operand(node: gs.Node, tensor: gs.Tensor) -> gs.Tensor | None:
    a, b = node.inputs[0], node.inputs[1]
    if a is tensor:
        return b
    if b is tensor:
        return a
    return None
