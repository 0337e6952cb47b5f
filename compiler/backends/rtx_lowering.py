"""Lower the optimised paged graph to the slot contract (`slot_contract.py`) with native
TensorRT-RTX layers only (TensorRT-RTX takes no custom plugins).

What changes, and what does not:

* The token axis stays flat. ``input_ids [B, S]`` is reshaped to ``[B*S]`` at the top, so the
  embedding, RMSNorm, merged GEMMs, rotary embedding, SwiGLU and the logits gather run exactly as
  in the paged graph (``logits_indices`` already indexes the flat axis).
* ``positions`` stops being an input: it is ``cache_positions[b] + s``, computed once.
* Every ``trtc::PagedAttention`` becomes::

      q [T, H*D] -> [B, H, S, D];  k, v [T, KV*D] -> [B, KV, S, D]
      k_cache_out.i = TRT_KVCacheUpdate(k_cache.i, k, cache_positions)   (same for v)
      y = Attention(q, k_cache_out.i, v_cache_out.i, mask)  -> [T, H*D]

  ``TRT_KVCacheUpdate`` is TensorRT's own ONNX op (default domain, parsed to IKVCacheUpdateLayer,
  linear mode); ``Attention`` is ONNX opset 23 with 4-D inputs (TensorRT-RTX wants Q, K and V of
  one rank; GQA comes from the head counts of the shapes).
* One bool mask ``[B, 1, S, max_seq_len]`` per distinct sliding window, built once from
  ``cache_positions``: key ``j`` is visible to new token ``s`` of slot ``b`` iff
  ``j <= q = cache_positions[b] + s`` (and ``j > q - window``). ``q`` is clamped to
  ``max_seq_len - 1`` so no row is ever all-masked (padding rows stay finite, never NaN).
* ``Attention`` carries ``TRT_decomposable=1`` (read by TensorRT's ONNX parser): TensorRT-RTX
  has no fused fp32 attention kernel and refuses to build one otherwise; where a fused kernel
  exists (fp16/bf16) it is still the one chosen.

Precision is untouched (strongly typed: the graph's dtypes are the engine's). A KV cache dtype
other than the model's is written through a Cast and read back through a Cast of the whole cache
to the model dtype, because TensorRT-RTX's attention fusion does not attend in the cache dtype;
that costs a pass over the cache per layer, so prefer the model dtype. ``RotaryEmbedding`` and
``RMSNormalization`` stay: the RTX parser takes them. The ``trtc::SwiGLU`` local function is
inlined: the parser takes functions too, but imports every call under the body's node names and
warns that all but the first are not queryable.

Quantized GEMMs become DequantizeLinear + MatMul, the pattern of TensorRT's weight-only INT4 and
FP8 GEMMs:

* ``trtc::Int4Gemm`` (plugins/int4_gemm/reference.py), since ``(q - z) s = (q - 8) s + (8 - z) s``::

      w = DequantizeLinear(INT4 [N, K] holding q - 8, block_scales, axis=1, block_size=b)
      y = x @ Transpose(w)  +  (x @ E) @ shift  (+ bias)
      E [K, G] one-hot (column k -> group k // g);  shift [G, N] = ((8 - zeros) * scales).T

  The parser takes signed INT4 only, no zero point and whole blocks only. Hence the packed bytes
  XOR 0x88 are the INT4 ``q - 8`` in the same layout; the zero points become a correction through
  the ``G = ceil(K / g)`` group sums of x (two small GEMMs); and the blocks are ``b = gcd(g, K)``
  columns, each group's scale repeated ``g / b`` times, which is exact because every block lies
  inside one group (``b = g`` when g divides K). The DQ runs along axis 1 of the ``[N, K]``
  weight, the bytes' own layout, and a Transpose feeds the MatMul, so the bytes are not repacked.
* ``trtc::Fp8Gemm`` (plugins/fp8_gemm/reference.py)::

      x_q = DequantizeLinear(QuantizeLinear(x, input_scale, E4M3 zero, saturate=1), input_scale)
      y   = x_q @ Transpose(DequantizeLinear(weight, weight_scale, axis=0))  (+ bias)

  The scales stay fp32 as the plugin defines them (``x / input_scale`` in fp32); the DQs' opset-23
  ``output_dtype`` makes their outputs the model dtype. TensorRT-RTX builds E4M3 engines for sm89
  and newer only, so the config check refuses FP8 on Ampere before any work.

Built CPU-only, the plan keeps the weights INT4 / FP8; which kernel runs is chosen on the GPU.
What the parser refused, and the variants measured against these choices, are in
docs/design-notes.md ("TensorRT-RTX lowering").
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnx
import onnx.inliner
import onnx.numpy_helper
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import dtype_to_onnx

from trtc import contract as paged
from trtc import slot_contract as slot
from trtc.artifact import Manifest
from trtc.errors import BuildError
from trtc.plugins import PAGED_ATTENTION
from trtc.plugins.spec import DOMAIN

KV_CACHE_UPDATE = "TRT_KVCacheUpdate"  # TensorRT's ONNX op, default domain
QUANTIZED_GEMMS = ("Int4Gemm", "Fp8Gemm")
INT4_ZERO = 8  # uint4 q (0..15) = int4 (q - 8) + 8
FP8 = onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.FLOAT8E4M3FN)
NUMPY_DTYPES = {
    "fp32": np.float32,
    "fp16": np.float16,
    "bf16": onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.BFLOAT16),
}


def check_lowerable(model: onnx.ModelProto) -> None:
    """Custom-domain nodes the RTX lowering cannot rewrite are a build error, named."""
    local_functions = {(f.domain, f.name) for f in model.functions}
    lowered_here = {PAGED_ATTENTION.op_type, *QUANTIZED_GEMMS}
    unknown = sorted(
        {
            f"{n.domain}::{n.op_type}"
            for n in model.graph.node
            if n.domain not in ("", "ai.onnx")
            and (n.domain, n.op_type) not in local_functions
            and not (n.domain == DOMAIN and n.op_type in lowered_here)
        }
    )
    if unknown:
        raise BuildError(
            f"backend tensorrt-rtx: no native lowering for {', '.join(unknown)} "
            f"(TensorRT-RTX takes no custom plugins; it lowers "
            f"{', '.join(f'{DOMAIN}::{op}' for op in sorted(lowered_here))})"
        )
    if not any(
        n.domain == DOMAIN and n.op_type == PAGED_ATTENTION.op_type for n in model.graph.node
    ):
        raise BuildError(
            "backend tensorrt-rtx: the graph has no trtc::PagedAttention node to lower "
            "(is it a trtc model.onnx?)"
        )


class _Builder:
    """Appends nodes to a graph, naming every tensor after its node."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self.shared: dict[str, gs.Constant] = {}  # constants several nodes read, made once

    def const(self, name: str, value) -> gs.Constant:
        return gs.Constant(name, np.asarray(value))

    def ints(self, name: str, value) -> gs.Constant:
        """An int64 constant (a scalar, or a list for shapes and axes)."""
        return self.const(name, np.array(value, np.int64))

    def unsqueeze(self, name: str, x: gs.Tensor, axis: int, axis_name: str, dtype) -> gs.Variable:
        return self.op("Unsqueeze", name, [x, self.ints(axis_name, [axis])], dtype)

    def op(
        self, op: str, name: str, inputs: list, dtype=None, outputs: list | None = None, **attrs
    ) -> gs.Variable:
        outputs = outputs or [gs.Variable(f"{name}.out", dtype=dtype)]
        self.graph.nodes.append(gs.Node(op, name=name, inputs=inputs, outputs=outputs, attrs=attrs))
        return outputs[0]


def _step_tensors(
    b: _Builder,
    input_ids: gs.Variable,
    cache_positions: gs.Variable,
    max_seq_len: int,
    rope_rows: int,
    windows: set[int],
):
    """Token shape, flat positions and one attention mask per sliding window (0 = none)."""
    ids_shape = b.op("Shape", "step.ids_shape", [input_ids], np.int64)  # [B, S]
    new_tokens = b.op(
        "Gather", "step.new_tokens", [ids_shape, b.ints("step.one", 1)], np.int64, axis=0
    )
    offsets = b.op(
        "Range",
        "step.offsets",
        [b.ints("step.zero", 0), new_tokens, b.ints("step.step", 1)],
        np.int64,
    )  # [S]
    cached = b.op("Cast", "step.cached", [cache_positions], np.int64, to=onnx.TensorProto.INT64)
    query_pos = b.op(
        "Add",
        "step.query_positions",
        [
            b.unsqueeze("step.cached_col", cached, 1, "step.axis1", np.int64),
            b.unsqueeze("step.offsets_row", offsets, 0, "step.axis0", np.int64),
        ],
        np.int64,
    )  # [B, S]

    def at_most(name: str, limit_name: str, limit: int) -> gs.Variable:
        return b.op("Min", name, [query_pos, b.ints(limit_name, limit)], np.int64)

    # Padding tokens may run past the rope table; their results are never read.
    rope_pos = at_most("step.rope_positions", "step.rope_last", rope_rows - 1)
    flat_positions = b.op(
        "Reshape", "step.positions", [rope_pos, b.ints("step.flat", [-1])], np.int64
    )
    last = at_most("step.mask_query", "step.cache_last", max_seq_len - 1)
    last = b.unsqueeze("step.mask_query_col", last, 2, "step.axis2", np.int64)  # [B, S, 1]
    keys = b.const("step.key_positions", np.arange(max_seq_len, dtype=np.int64))  # [Smax]
    causal = b.op("LessOrEqual", "step.causal", [keys, last], np.bool_)  # [B, S, Smax]
    masks = {}
    for window in sorted(windows):
        visible = causal
        if window > 0:
            w = f"step.window{window}"
            first = b.op("Sub", f"{w}.first", [last, b.ints(w, window)], np.int64)
            inside = b.op("Greater", f"{w}.inside", [keys, first], np.bool_)
            visible = b.op("And", f"{w}.visible", [causal, inside], np.bool_)
        tag = f"window{window}" if window else "causal"
        masks[window] = b.unsqueeze(
            f"step.mask.{tag}", visible, 1, f"step.mask.{tag}.axis1", np.bool_
        )
    return ids_shape, flat_positions, masks


def _lower_attention(
    b: _Builder,
    node: gs.Node,
    layer: int,
    ids_shape: gs.Variable,
    cache_positions: gs.Variable,
    masks: dict,
    caches: dict,
    dtype,
    kv_dtype,
) -> None:
    a = node.attrs
    heads, kv_heads, head_dim = int(a["num_heads"]), int(a["num_kv_heads"]), int(a["head_dim"])
    query, key, value = node.inputs[:3]
    attn_out = node.outputs[0]
    p = f"model.layers.{layer}.self_attn"

    def to_bhsd(x, n, what):  # [B*S, n*D] -> [B, n, S, D]
        shape = b.op(
            "Concat",
            f"{p}.{what}_shape",
            [ids_shape, b.ints(f"{p}.{what}_heads", [n, head_dim])],
            np.int64,
            axis=0,
        )
        x = b.op("Reshape", f"{p}.{what}_bshd", [x, shape], dtype)
        return b.op("Transpose", f"{p}.{what}_bhsd", [x], dtype, perm=[0, 2, 1, 3])

    q, k, v = to_bhsd(query, heads, "q"), to_bhsd(key, kv_heads, "k"), to_bhsd(value, kv_heads, "v")
    if kv_dtype != dtype:
        to = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(kv_dtype))
        k, v = (
            b.op("Cast", f"{p}.{w}_kv_dtype", [x], kv_dtype, to=to) for w, x in (("k", k), ("v", v))
        )
    k_in, v_in, k_out, v_out = caches[layer]
    b.op(KV_CACHE_UPDATE, f"{p}.k_cache_update", [k_in, k, cache_positions], outputs=[k_out])
    b.op(KV_CACHE_UPDATE, f"{p}.v_cache_update", [v_in, v, cache_positions], outputs=[v_out])
    keys, values = k_out, v_out
    if kv_dtype != dtype:
        to = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        keys, values = (
            b.op("Cast", f"{p}.{w}_model_dtype", [x], dtype, to=to)
            for w, x in (("keys", keys), ("values", values))
        )
    y = b.op(
        "Attention",
        f"{p}.attention",
        [q, keys, values, masks[int(a.get("sliding_window", 0))]],
        dtype,
        scale=float(a["scale"]),
        is_causal=0,
        TRT_decomposable=1,
    )
    y = b.op("Transpose", f"{p}.attn_bshd", [y], dtype, perm=[0, 2, 1, 3])
    attn_out.inputs.clear()
    b.op(
        "Reshape",
        f"{p}.attn_flat",
        [y, b.ints(f"{p}.attn_width", [-1, heads * head_dim])],
        outputs=[attn_out],
    )


# --- quantized GEMMs ----------------------------------------------------------------------------


def _weights(node: gs.Node, names: tuple[str, ...]) -> list[gs.Constant]:
    """A quantized GEMM's weight inputs, which must be graph constants (not loaded here)."""
    inputs = node.inputs[1 : 1 + len(names)]
    loose = [n for n, t in zip(names, inputs) if not isinstance(t, gs.Constant)]
    if len(inputs) < len(names) or loose:
        raise BuildError(
            f"backend tensorrt-rtx: {node.op} node {node.name}: {', '.join(loose or names)} "
            f"must be constant weights to lower to DequantizeLinear"
        )
    return list(inputs)


def _array(t: gs.Constant) -> np.ndarray:
    """A constant's values in its own dtype (graphsurgeon would upcast bf16, with a warning)."""
    lazy = t._values
    return (
        onnx.numpy_helper.to_array(lazy.tensor)
        if isinstance(lazy, gs.ir.tensor.LazyValues)
        else np.asarray(lazy)
    )


def _type_name(t: gs.Constant) -> str:
    """The ONNX element type of a constant, without loading its values."""
    return onnx.helper.tensor_dtype_to_string(dtype_to_onnx(t.dtype)).removeprefix("TensorProto.")


def _bias(b: _Builder, node: gs.Node, y: gs.Variable, dtype) -> gs.Variable:
    """``y + bias`` when the node has its optional 5th input (a constant [N])."""
    if len(node.inputs) < 5 or node.inputs[4] is None or not node.inputs[4].name:
        return y
    return b.op("Add", f"{node.name}.bias_add", [y, node.inputs[4]], dtype)


def _int4_constant(name: str, qweight: np.ndarray) -> gs.Constant:
    """uint8 ``[N, K/2]`` (two uint4 a byte, low nibble first) -> an ONNX INT4 ``[N, K]`` holding
    ``q - 8``: flipping bit 3 of each nibble is ``(q - 8) mod 16``, the two's complement nibble,
    so the bytes keep their layout. TensorRT-RTX imports INT4 initializers but not UINT4."""
    n, half_k = qweight.shape
    proto = onnx.helper.make_tensor(
        name, onnx.TensorProto.INT4, [n, 2 * half_k], (qweight ^ 0x88).tobytes(), raw=True
    )
    return gs.Constant(name, gs.ir.tensor.LazyValues(proto))


def _group_sum_matrix(b: _Builder, k: int, group_size: int, dtype) -> gs.Constant:
    """One-hot ``[K, G]``: ``x @ E`` sums each group's columns (a short last group included).
    Shared by every node with the same K and group size."""
    name = f"int4.group_sum.k{k}.g{group_size}"
    if name not in b.shared:
        e = np.zeros((k, -(-k // group_size)), dtype)
        e[np.arange(k), np.arange(k) // group_size] = 1
        b.shared[name] = b.const(name, e)
    return b.shared[name]


def _dequantized_matmul(
    b: _Builder, p: str, x: gs.Tensor, dq_inputs: list, dtype, **dq_attrs
) -> gs.Variable:
    """``x @ Transpose(DequantizeLinear(*dq_inputs))``: the weight stays ``[N, K]``, its bytes'
    own layout, and the Transpose feeds the MatMul."""
    w = b.op("DequantizeLinear", f"{p}.dequantize", dq_inputs, dtype, **dq_attrs)  # [N, K]
    w_t = b.op("Transpose", f"{p}.weight_t", [w], dtype, perm=[1, 0])  # [K, N]
    return b.op("MatMul", f"{p}.matmul", [x, w_t], dtype)


def _lower_int4_gemm(b: _Builder, node: gs.Node, dtype) -> None:
    """``trtc::Int4Gemm`` (plugins/int4_gemm/reference.py) as symmetric INT4 block DQ + MatMul
    plus a zero-point correction (see the module docstring)::

        y = x @ DQ(q - 8, s).T  +  (x @ E) @ ((8 - zeros) * s).T  (+ bias)
    """
    g, k, n = (int(node.attrs[a]) for a in ("group_size", "in_features", "out_features"))
    qweight, scales, zeros = (_array(t) for t in _weights(node, ("qweight", "scales", "zeros")))
    groups = -(-k // g)
    if (qweight.dtype, qweight.shape, scales.shape, zeros.dtype, zeros.shape) != (
        np.uint8,
        (n, k // 2),
        (n, groups),
        np.uint8,
        (n, groups),
    ):
        raise BuildError(
            f"backend tensorrt-rtx: Int4Gemm node {node.name} (K={k}, N={n}, group {g}): "
            f"qweight {qweight.dtype}{list(qweight.shape)}, scales {list(scales.shape)}, zeros "
            f"{zeros.dtype}{list(zeros.shape)}; expected uint8[{n}, {k // 2}], [{n}, {groups}], "
            f"uint8[{n}, {groups}]"
        )
    p, x = node.name, node.inputs[0]
    # TensorRT-RTX wants whole blocks: blocks of gcd(g, K) columns tile every row and each lies
    # inside one group, so repeating each group's scale g / block times is exact.
    block = math.gcd(g, k)
    block_scales = np.repeat(scales.astype(np.float32), g // block, axis=1)[:, : k // block]
    weight = [
        _int4_constant(f"{p}.int4_weight", qweight),
        b.const(f"{p}.block_scales", block_scales.astype(dtype)),
    ]
    y = _dequantized_matmul(b, p, x, weight, dtype, axis=1, block_size=block)
    shift = ((INT4_ZERO - zeros.astype(np.float32)) * scales.astype(np.float32)).T  # [G, N]
    group_sums = b.op("MatMul", f"{p}.group_sums", [x, _group_sum_matrix(b, k, g, dtype)], dtype)
    correction = b.op(
        "MatMul",
        f"{p}.zero_correction",
        [group_sums, b.const(f"{p}.zero_shift", shift.astype(dtype))],
        dtype,
    )
    y = b.op("Add", f"{p}.zero_corrected", [y, correction], dtype)
    _replace(node, _bias(b, node, y, dtype))


def _lower_fp8_gemm(b: _Builder, node: gs.Node, dtype) -> None:
    """``trtc::Fp8Gemm`` (plugins/fp8_gemm/reference.py) as Q/DQ + MatMul::

    x_q = DQ(Q(x, input_scale) -> E4M3, saturating)      # fp32 scale, so x / input_scale in fp32
    y   = x_q @ DQ(weight, weight_scale, axis 0).T  (+ bias)
    """
    k, n = int(node.attrs["in_features"]), int(node.attrs["out_features"])
    weight, weight_scale, input_scale = _weights(node, ("weight", "weight_scale", "input_scale"))
    got = [(_type_name(t), tuple(t.shape)) for t in (weight, weight_scale, input_scale)]
    want = [("FLOAT8E4M3FN", (n, k)), ("FLOAT", (n,)), ("FLOAT", ())]
    if got != want:
        raise BuildError(
            f"backend tensorrt-rtx: Fp8Gemm node {node.name} (K={k}, N={n}): weight, "
            f"weight_scale, input_scale are {got}; expected {want}"
        )
    p, x = node.name, node.inputs[0]
    model_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    if "fp8.zero_point" not in b.shared:
        b.shared["fp8.zero_point"] = b.const("fp8.zero_point", np.zeros((), FP8))
    x_fp8 = b.op(
        "QuantizeLinear",
        f"{p}.quantize_input",
        [x, input_scale, b.shared["fp8.zero_point"]],
        FP8,
        saturate=1,
    )
    x_q = b.op(
        "DequantizeLinear",
        f"{p}.dequantize_input",
        [x_fp8, input_scale],
        dtype,
        output_dtype=model_type,
    )
    y = _dequantized_matmul(
        b, p, x_q, [weight, weight_scale], dtype, axis=0, output_dtype=model_type
    )
    _replace(node, _bias(b, node, y, dtype))


def _replace(node: gs.Node, y: gs.Variable) -> None:
    """Make ``y``'s producer write the plugin node's output tensor (its consumers keep reading
    it) and detach the plugin node, which the caller then drops."""
    out, producer = node.outputs[0], y.inputs[0]
    node.outputs.clear()
    node.inputs.clear()
    producer.outputs.clear()
    producer.outputs.append(out)


def lower_quantized_gemms(graph: gs.Graph, dtype, builder: _Builder | None = None) -> Counter:
    """Rewrite every ``trtc::Int4Gemm`` / ``trtc::Fp8Gemm`` of ``graph`` in place (``dtype``: the
    model's numpy dtype); returns how many of each. The plugin nodes are removed."""
    b = builder or _Builder(graph)
    done = Counter()
    for n in [n for n in graph.nodes if n.domain == DOMAIN and n.op in QUANTIZED_GEMMS]:
        (_lower_int4_gemm if n.op == "Int4Gemm" else _lower_fp8_gemm)(b, n, dtype)
        done[n.op] += 1
    graph.nodes = [n for n in graph.nodes if n.inputs or n.outputs]
    return done


def lower_for_rtx(model: onnx.ModelProto, manifest: Manifest, max_seq_len: int) -> onnx.ModelProto:
    """The paged ``model.onnx`` of an artifact, rewritten to the slot contract (a new model)."""
    check_lowerable(model)
    table_rows = manifest.limits.max_seq_len
    if not 1 <= max_seq_len <= table_rows:
        raise BuildError(
            f"backend tensorrt-rtx: max_seq_len {max_seq_len} must be from 1 to the "
            f"artifact's limits.max_seq_len {table_rows} (the rotary tables' length)"
        )
    c = slot.SlotContract.from_manifest(manifest, max_seq_len)
    graph = gs.import_onnx(onnx.inliner.inline_local_functions(model))
    for n in graph.nodes:  # inlined function bodies come unnamed
        n.name = n.name or f"{n.outputs[0].name}.{n.op.lower()}"
    tensors = graph.tensors()
    dtype = NUMPY_DTYPES[manifest.precision]
    kv_dtype = NUMPY_DTYPES[c.kv_dtype]
    nodes = [n for n in graph.nodes if n.domain == DOMAIN and n.op == PAGED_ATTENTION.op_type]
    layer_of = _attention_layers(nodes, c.num_layers)

    # New graph inputs; the old token-axis tensors become internal, produced from them.
    input_ids, cache_positions, logits_indices, caches = _slot_inputs(c, tensors, kv_dtype)
    b = _Builder(graph)
    windows = {int(n.attrs.get("sliding_window", 0)) for n in nodes}
    ids_shape, flat_positions, masks = _step_tensors(
        b, input_ids, cache_positions, max_seq_len, table_rows, windows
    )
    flat_ids = tensors["input_ids"]
    flat_ids.name = "input_ids.flat"
    b.op(
        "Reshape",
        "step.input_ids_flat",
        [input_ids, b.ints("step.ids_flat", [-1])],
        outputs=[flat_ids],
    )
    old_positions = tensors["positions"]
    for consumer in list(old_positions.outputs):
        consumer.inputs = [flat_positions if t is old_positions else t for t in consumer.inputs]

    for n in nodes:
        _lower_attention(
            b, n, layer_of[id(n)], ids_shape, cache_positions, masks, caches, dtype, kv_dtype
        )
        n.outputs.clear()
        n.inputs.clear()
    lower_quantized_gemms(graph, dtype, b)
    graph.nodes = [n for n in graph.nodes if n.inputs or n.outputs]
    tensors["logits"].shape = [slot.BATCH, c.vocab_size]
    graph.inputs = [input_ids, cache_positions, logits_indices]
    graph.outputs = [tensors["logits"]]
    for i in range(c.num_layers):
        graph.inputs += caches[i][:2]
        graph.outputs += caches[i][2:]
    return _export_slot_graph(graph, c, max_seq_len)


def _attention_layers(nodes: list[gs.Node], num_layers: int) -> dict[int, int]:
    """The layer of each PagedAttention node (by ``id``), from the KV cache it reads; one node
    per layer, or an error."""
    layer_of = {}
    for n in nodes:
        name = n.inputs[3].name
        layer = next((i for i in range(num_layers) if name == paged.kv_input_name(i)), None)
        if layer is None:
            raise BuildError(
                f"backend tensorrt-rtx: PagedAttention node {n.name} reads {name}, "
                f"not a layer's KV cache"
            )
        layer_of[id(n)] = layer
    if sorted(layer_of.values()) != list(range(num_layers)):
        raise BuildError(
            f"backend tensorrt-rtx: expected one PagedAttention node per layer "
            f"({num_layers}), found layers {sorted(layer_of.values())}"
        )
    return layer_of


def _slot_inputs(c: slot.SlotContract, tensors: dict, kv_dtype) -> tuple:
    """The slot contract's inputs ``input_ids`` and ``cache_positions`` (new), and
    ``logits_indices`` (the paged graph's, reshaped); each layer's ``(k_cache, v_cache,
    k_cache_out, v_cache_out)``."""
    spec = {t.name: t for t in c.inputs()}

    def new_input(name, np_dtype):
        return gs.Variable(name, dtype=np_dtype, shape=list(spec[name].shape))

    input_ids = new_input("input_ids", np.int64)
    cache_positions = new_input("cache_positions", np.int32)
    logits_indices = tensors["logits_indices"]
    logits_indices.shape = list(spec["logits_indices"].shape)
    caches = {}
    for i in range(c.num_layers):
        caches[i] = (
            new_input(slot.k_cache_name(i), kv_dtype),
            new_input(slot.v_cache_name(i), kv_dtype),
            gs.Variable(slot.k_cache_out_name(i), dtype=kv_dtype, shape=list(c.cache_shape)),
            gs.Variable(slot.v_cache_out_name(i), dtype=kv_dtype, shape=list(c.cache_shape)),
        )
    return input_ids, cache_positions, logits_indices, caches


def _export_slot_graph(graph: gs.Graph, c: slot.SlotContract, max_seq_len: int):
    """The lowered graph as an ONNX model, marked with its KV layout and context length, its
    I/O checked against the slot contract."""
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    lowered = gs.export_onnx(graph)
    lowered.doc_string = f"trtc slot-contract graph for tensorrt-rtx (max_seq_len {max_seq_len})"
    del lowered.metadata_props[:]
    lowered.metadata_props.add(key="trtc.kv_layout", value=slot.KV_LAYOUT)
    lowered.metadata_props.add(key="trtc.max_seq_len", value=str(max_seq_len))
    names = [t.name for t in c.inputs()], [t.name for t in c.outputs()]
    got = [i.name for i in lowered.graph.input], [o.name for o in lowered.graph.output]
    if got != names:  # the contract is the one source; the graph must say the same
        raise BuildError(
            f"backend tensorrt-rtx: lowered graph I/O {got} differs from the slot contract {names}"
        )
    return lowered


def lowering_summary(lowered: onnx.ModelProto) -> dict:
    """Op counts of a lowered graph (what the manifest records for the RTX graph)."""
    ops = Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in lowered.graph.node)
    return {"num_nodes": len(lowered.graph.node), "op_counts": dict(sorted(ops.items()))}
