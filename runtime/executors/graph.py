"""The node list an executor runs, and the small rewrite core its load-time fusions share.

An executor loads the artifact's ONNX graph as a list of `GraphNode` (ops by name, tensors by
name, constants on the device) and runs it in order. Fusions (`fusions/`) rewrite that list at
load time through `NodeGraph`: who produces and who reads each tensor, which nodes a fusion has
already taken, and the small integer constants (axes, split sizes) kept on the host. The
artifact itself is never changed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

Op = Callable[[list, dict], list]  # (inputs, attrs) -> outputs
OpTable = Mapping[tuple[str, str], Op]  # (domain, op_type) -> implementation

# Ops that exist only inside an executor (the results of its fusions), never in an artifact.
RUNTIME_DOMAIN = "trtc.runtime"


class GraphNode(NamedTuple):
    """One node as an executor runs it: ``ops[op](inputs, attrs) -> outputs`` (by tensor name;
    an empty name is an absent optional input)."""

    op: tuple[str, str]  # (domain, op_type)
    inputs: list[str]
    outputs: list[str]
    attrs: dict


class NodeGraph:
    """A node list being rewritten: fusions `replace` or `remove` nodes by index, and `nodes`
    returns the result. A node a fusion took is not offered to the next one."""

    def __init__(
        self, nodes: list[GraphNode], constants: dict[str, torch.Tensor], outputs: set[str]
    ):
        self.original = nodes
        self.constants = constants  # mutable: a layout rewrite swaps tensors in place
        self.graph_outputs = outputs
        self.readers: dict[str, list[int]] = {}
        self.producer: dict[str, int] = {}
        for i, n in enumerate(nodes):
            for name in n.inputs:
                self.readers.setdefault(name, []).append(i)
            for name in n.outputs:
                self.producer[name] = i
        self._replaced: dict[int, GraphNode | None] = {}
        # Axes and split sizes: small integer constants, kept on the host by the executor.
        self._host_ints = {
            k: [int(x) for x in v.reshape(-1).tolist()]
            for k, v in constants.items()
            if not v.dtype.is_floating_point and v.numel() <= 8 and v.device.type == "cpu"
        }

    def free(self, i: int | None) -> bool:
        """``i`` is a node no fusion has taken yet."""
        return i is not None and i not in self._replaced

    def op(self, i: int | None) -> tuple[str, str] | None:
        return None if i is None else self.original[i].op

    def only_reader(self, tensor: str) -> int | None:
        """The one node that reads ``tensor``, if exactly one does and it is no graph output."""
        readers = self.readers.get(tensor, [])
        if len(readers) == 1 and tensor not in self.graph_outputs:
            return readers[0]
        return None

    def ready_before(self, tensor: str, i: int) -> bool:
        """``tensor`` exists when node ``i`` runs: a constant, a graph input, or the output of
        an earlier node (what a fusion that moves a reader's inputs to node ``i`` checks)."""
        return self.producer.get(tensor, -1) < i

    def current(self, i: int | None) -> GraphNode | None:
        """Node ``i`` as the fusions so far left it (a fused node, or None where removed)."""
        if i is None:
            return None
        return self._replaced[i] if i in self._replaced else self.original[i]

    def int_values(self, tensor: str) -> list[int] | None:
        """The values of a small integer constant (an axis, split sizes), if it is one."""
        return self._host_ints.get(tensor)

    def is_constant(self, tensor: str) -> bool:
        return tensor in self.constants

    def replace(self, i: int, node: GraphNode) -> None:
        self._replaced[i] = node

    def remove(self, *indices: int) -> None:
        for i in indices:
            self._replaced[i] = None

    def nodes(self) -> list[GraphNode]:
        out = (self._replaced.get(i, n) for i, n in enumerate(self.original))
        return [n for n in out if n is not None]


@dataclass(frozen=True)
class Fusion:
    """One load-time rewrite: the ops its new nodes run, and ``apply(graph) -> count``."""

    name: str
    ops: OpTable
    apply: Callable[[NodeGraph], int]
