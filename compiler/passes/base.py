"""What every graph pass shares: the result it reports and small graph-walking helpers."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass
class PassResult:
    name: str
    matched: int = 0
    per_layer: Counter = field(default_factory=Counter)  # layer index (or "final") -> count
    notes: list[str] = field(default_factory=list)

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
    if isinstance(tensor, gs.Constant):
        return tensor.values
    node = producer(tensor, "Constant")
    if node is not None:
        return node.attrs["value"].values
    return None


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
