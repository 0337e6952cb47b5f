"""Rotary embedding fusion.

Matches the non-interleaved RoPE spelling of `trtc.compiler.model.apply_rotary`::

    v = Reshape(y, [T, -1, D]); x1, x2 = v[..., :D/2], v[..., D/2:]
    c, s = Unsqueeze(Gather(cos_table, positions), 1), Unsqueeze(Gather(sin_table, positions), 1)
    out = Reshape(Concat(x1*c - x2*s, x2*c + x1*s), [T, -1])

and replaces it with ONNX ``RotaryEmbedding`` (opset 23) over ``y[1, T, heads*D]`` that reads
the tables by position itself, so the per-layer gathers disappear. ``y`` is a projection's
output, or (Qwen3) the per-head norm's output reshaped back to ``[T, heads*D]``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_graphsurgeon as gs

from trtc.compiler.passes.base import PassResult, const_value, producer, weight_layer


def _slice_half(node: gs.Node | None, half: int) -> tuple[gs.Tensor, str] | None:
    if node is None or node.op != "Slice":
        return None
    starts, ends = const_value(node.inputs[1]), const_value(node.inputs[2])
    axes = const_value(node.inputs[3]) if len(node.inputs) > 3 else None
    if starts is None or ends is None or axes is None or list(axes.reshape(-1)) not in ([-1], [2]):
        return None
    start, end = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
    if start == 0 and end == half:
        return node.inputs[0], "low"
    if start == half and end >= 2 * half:
        return node.inputs[0], "high"
    return None


def _table(unsq_out: gs.Tensor) -> tuple[gs.Constant, gs.Tensor] | None:
    """``Unsqueeze(Gather(table, positions), 1)`` -> (table, positions)."""
    unsq = producer(unsq_out, "Unsqueeze")
    gather = unsq and producer(unsq.inputs[0], "Gather")
    if gather is None or not isinstance(gather.inputs[0], gs.Constant):
        return None
    return gather.inputs[0], gather.inputs[1]


def _layer(y: gs.Tensor):
    """The layer ``y`` belongs to: its producer's weights (a projection), or through the Reshape
    back to ``[T, heads*D]`` the per-head norm's (Qwen3's q_norm / k_norm)."""
    node = producer(y)
    if node is not None and node.op == "Reshape":
        node = producer(node.inputs[0], "RMSNormalization") or node
    return weight_layer(node) if node is not None else "final"


class _Match(NamedTuple):
    """A matched rotary spelling: its input ``y``, tables, positions and final Reshape."""

    y: gs.Tensor
    cos: gs.Constant
    sin: gs.Constant
    positions: gs.Tensor
    reshape_out: gs.Node


def _operand_roles(muls: list[gs.Node]) -> dict[int, tuple]:
    """For each ``Mul`` (by id) of a half of the input and a table row: ``((input, "low" or
    "high"), table, positions)``."""
    roles = {}
    for mul in muls:
        for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            tab = _table(b)
            if tab is None:
                continue
            table, positions = tab
            half = table.values.shape[-1]
            sl = _slice_half(producer(a), half)
            if sl is not None:
                roles[id(mul)] = (sl, table, positions)
                break
    return roles


def _match(concat: gs.Node) -> _Match | None:
    """The rotary spelling whose halves ``concat`` joins, or None."""
    if concat.attrs.get("axis") not in (-1, 2):
        return None
    sub, add = producer(concat.inputs[0], "Sub"), producer(concat.inputs[1], "Add")
    if sub is None or add is None:
        return None
    m_sub = [producer(t, "Mul") for t in sub.inputs]
    m_add = [producer(t, "Mul") for t in add.inputs]
    if any(m is None for m in m_sub + m_add):
        return None
    # x1*c (Mul 0 of Sub): find the Slice operand and the table operand.
    roles = _operand_roles(m_sub + m_add)
    if len(roles) != 4:
        return None
    (src, part0), cos, pos = roles[id(m_sub[0])]
    sources = {r[0][0].name for r in roles.values()}
    positions = {r[2].name for r in roles.values()}
    tables_sub = (roles[id(m_sub[0])][1], roles[id(m_sub[1])][1])
    if len(sources) != 1 or len(positions) != 1 or part0 != "low" or tables_sub[0] is tables_sub[1]:
        return None
    sin = tables_sub[1]
    # Spelling check: x1*cos - x2*sin and (x2*cos + x1*sin) in either order.
    add_parts = {(roles[id(m)][0][1], roles[id(m)][1].name) for m in m_add}
    if roles[id(m_sub[1])][0][1] != "high" or add_parts != {
        ("high", cos.name),
        ("low", sin.name),
    }:
        return None
    shape_in = producer(src, "Reshape")
    reshape_out = concat.outputs[0].outputs[0] if len(concat.outputs[0].outputs) == 1 else None
    if shape_in is None or reshape_out is None or reshape_out.op != "Reshape":
        return None
    return _Match(shape_in.inputs[0], cos, sin, pos, reshape_out)


def _position_row(graph: gs.Graph, pos: gs.Tensor) -> gs.Variable:
    """``positions`` as the ``[1, T]`` row RotaryEmbedding reads (a new Unsqueeze)."""
    row = gs.Variable(
        f"{pos.name}.row",
        dtype=pos.dtype,
        shape=[1, pos.shape[0] if pos.shape else "num_tokens"],
    )
    graph.nodes.append(
        gs.Node(
            "Unsqueeze",
            name=f"{pos.name}.unsqueeze",
            inputs=[pos, gs.Constant(f"{pos.name}.axis0", np.array([0], np.int64))],
            outputs=[row],
        )
    )
    return row


def _replace(graph: gs.Graph, m: _Match, position_row: gs.Variable, num_heads: int) -> None:
    """The matched spelling's output, produced instead by ``RotaryEmbedding`` over
    ``y[1, T, heads*D]`` (between an Unsqueeze and a Squeeze)."""
    name = f"rotary.{m.y.name}"
    y3 = gs.Variable(f"{name}.in", dtype=m.y.dtype)
    r3 = gs.Variable(f"{name}.out", dtype=m.y.dtype)
    zero = gs.Constant(f"{name}.axis0", np.array([0], np.int64))
    out = m.reshape_out.outputs[0]
    out.inputs.clear()
    graph.nodes += [
        gs.Node("Unsqueeze", name=f"{name}.unsqueeze", inputs=[m.y, zero], outputs=[y3]),
        gs.Node(
            "RotaryEmbedding",
            name=name,
            inputs=[y3, m.cos, m.sin, position_row],
            outputs=[r3],
            attrs={"num_heads": num_heads, "interleaved": 0},
        ),
        gs.Node("Squeeze", name=f"{name}.squeeze", inputs=[r3, zero], outputs=[out]),
    ]


def fuse_rotary(graph: gs.Graph) -> PassResult:
    result = PassResult("rotary")
    position_rows: dict[str, gs.Variable] = {}
    for concat in [n for n in graph.nodes if n.op == "Concat" and len(n.inputs) == 2]:
        m = _match(concat)
        if m is None:
            continue
        head_dim = 2 * m.cos.values.shape[-1]
        # The fused node takes [1, T, heads*D]: y must be 2-D of a known width (a [T, heads, D]
        # input would pass as one head of D).
        width = m.y.shape[-1] if m.y.shape and len(m.y.shape) == 2 else None
        if not isinstance(width, (int, np.integer)) or width % head_dim:
            result.notes.append(
                f"skipped {concat.name}: its input {m.y.name} is not [tokens, heads*{head_dim}]"
            )
            continue
        if m.positions.name not in position_rows:
            position_rows[m.positions.name] = _position_row(graph, m.positions)
        layer = _layer(m.y)
        _replace(graph, m, position_rows[m.positions.name], int(width // head_dim))
        result.count(layer)
    return result
