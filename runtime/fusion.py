"""Kernel fusion for the CUDA executor: node patterns of a trtc graph replaced by one Triton
kernel each, at load time. The artifact is not changed; each fused node computes exactly what
its nodes compute one after the other (tests run both and compare).

A decode step of a small model costs about as much per kernel as per byte of weights, so the
executor runs fewer, larger kernels:

* ``Add -> RMSNormalization`` (a residual add and the norm that reads its sum) becomes
  ``AddRMSNorm``: both outputs in one pass over the row.
* ``Split(qkv) -> [Unsqueeze -> RotaryEmbedding -> Squeeze] x2 -> PagedAttention`` becomes
  ``QKVRotaryCacheWrite`` (rotate q; rotate k and write it and v into their cache slots) followed by
  ``PagedAttentionCached`` (the plugin's attention over a cache that already holds the new
  tokens). Two rotary kernels, the copies of the strided q/k/v slices and the plugin's own
  cache-write kernel collapse into one.

* ``Gemm -> SwiGLU`` (the MLP's gate/up projection and its activation) becomes ``GemmSwiGLU``:
  at a decode step's few tokens the GEMV (`runtime/triton_gemv.py`) ends in SwiGLU, one kernel
  fewer per layer; otherwise the two ops as they are.

A pattern that does not match exactly (other consumers of an intermediate, other attributes) is
left as it is.

One rewrite changes how a node's weights are held rather than which nodes run:

* ``Int4Gemm`` with fp16 or bf16 constant weights becomes ``Int4GemmFragment``: the executor
  holds the weight in the fragment kernel's layout (`plugins/int4_gemm/fragment_kernel.py`)
  instead of the plugin's (the same packed bytes reordered, records of 4 bytes a row and group
  for 3 of scales and zeros: `fragment_extra_bytes`). Calls of 1..32 tokens (decode steps) run
  that kernel (in launches of up to 16); longer ones (prefill, larger decode batches) dequantize
  the layer into a transient fp16 or bf16 weight and multiply with cuBLAS (`fragment_matmul`).
"""
from __future__ import annotations

from collections import Counter

import torch

from trtc.runtime.torch_ops import OPS, GraphNode, _gemm, _rms_norm, _swiglu

RUNTIME_DOMAIN = "trtc.runtime"      # ops that exist only inside an executor, never in an artifact
ADD_RMS_NORM = (RUNTIME_DOMAIN, "AddRMSNorm")
QKV_ROTARY_CACHE_WRITE = (RUNTIME_DOMAIN, "QKVRotaryCacheWrite")
PAGED_ATTENTION_CACHED = (RUNTIME_DOMAIN, "PagedAttentionCached")
GEMM_SWIGLU = (RUNTIME_DOMAIN, "GemmSwiGLU")
INT4_GEMM_FRAGMENT = (RUNTIME_DOMAIN, "Int4GemmFragment")


def _add_rms_norm(x, attrs):
    a, b, weight = x
    if a.shape != b.shape or attrs.get("axis", -1) % a.dim() != a.dim() - 1 or attrs.get("stash_type", 1) != 1:
        total = a + b                       # a broadcasting Add: the two ops as they are
        return [total, _rms_norm([total, weight], attrs)[0]]
    from trtc.runtime import triton_ops
    return list(triton_ops.add_rms_norm(a, b, weight, attrs.get("epsilon", 1e-5)))


def _qkv_rotary_cache_write(x, attrs):
    qkv, cos, sin, positions, kv_cache, slot_mapping = x
    from trtc.runtime import triton_ops
    return [triton_ops.qkv_rotary_write(qkv, cos, sin, positions, kv_cache, slot_mapping,
                                        attrs["num_heads"], attrs["num_kv_heads"],
                                        attrs.get("k_scale", 1.0), attrs.get("v_scale", 1.0))]


def _paged_attention_cached(x, attrs):
    query, kv_cache, block_tables, context_lens, query_start_loc = x
    from trtc.plugins.paged_attention.triton_kernels import paged_attention
    out, cache = paged_attention(query, None, None, kv_cache, None, block_tables, context_lens,
                                 query_start_loc, num_heads=attrs["num_heads"],
                                 num_kv_heads=attrs["num_kv_heads"], head_dim=attrs["head_dim"],
                                 scale=attrs["scale"], sliding_window=attrs.get("sliding_window", 0),
                                 k_scale=attrs.get("k_scale", 1.0), v_scale=attrs.get("v_scale", 1.0),
                                 write_kv=False)
    return [out, cache]


def _gemm_swiglu(x, attrs):
    a, weight = x[0], x[1]
    bias = x[2] if len(x) > 2 else None
    if a.is_cuda:
        from trtc.runtime import triton_gemv
        if triton_gemv.supports(a, weight, swiglu=True) and (bias is None or bias.dtype == a.dtype):
            return [triton_gemv.gemv(a, weight, bias, swiglu=True)]
    return _swiglu(_gemm(x, attrs), {})


def _int4_gemm_fragment(x, attrs):
    a, bias, words, records = x
    n, k, group = attrs["out_features"], attrs["in_features"], attrs["group_size"]
    from trtc.plugins.int4_gemm import fragment_kernel as fk
    # The rewrite checked the device.
    return [fk.fragment_gemm(a, fk.FragmentWeight(words, records, n, k, group), bias)]


OPS.update({ADD_RMS_NORM: _add_rms_norm, QKV_ROTARY_CACHE_WRITE: _qkv_rotary_cache_write,
            PAGED_ATTENTION_CACHED: _paged_attention_cached, GEMM_SWIGLU: _gemm_swiglu,
            INT4_GEMM_FRAGMENT: _int4_gemm_fragment})


class _Graph:
    """Who produces and who reads each tensor, for the pattern checks."""

    def __init__(self, nodes: list[GraphNode], constants: set[str], outputs: set[str]):
        self.nodes = nodes
        self.constants = constants
        self.readers: dict[str, list[int]] = {}
        for i, n in enumerate(nodes):
            for name in n.inputs:
                self.readers.setdefault(name, []).append(i)
        self.producer = {o: i for i, n in enumerate(nodes) for o in n.outputs}
        self.graph_outputs = outputs

    def only_reader(self, tensor: str) -> int | None:
        readers = self.readers.get(tensor, [])
        return readers[0] if len(readers) == 1 and tensor not in self.graph_outputs else None

    def op(self, i: int | None) -> tuple[str, str] | None:
        return None if i is None else self.nodes[i].op


def _fuse_add_rms_norm(g: _Graph, replaced: dict[int, GraphNode | None]) -> int:
    count = 0
    for i, n in enumerate(g.nodes):
        if n.op != ("", "Add") or i in replaced or any(t in g.constants for t in n.inputs):
            continue
        norms = [j for j in g.readers.get(n.outputs[0], []) if g.op(j) == ("", "RMSNormalization")
                 and g.nodes[j].inputs[0] == n.outputs[0] and j not in replaced]
        if not norms:
            continue
        norm = g.nodes[norms[0]]
        replaced[i] = GraphNode(ADD_RMS_NORM, [*n.inputs, norm.inputs[1]], [n.outputs[0], norm.outputs[0]],
                                norm.attrs)
        replaced[norms[0]] = None
        count += 1
    return count


def _rotary_chain(g: _Graph, tensor: str) -> tuple[list[int], str, GraphNode] | None:
    """``tensor -> Unsqueeze(0) -> RotaryEmbedding -> Squeeze(0)``: the three nodes, the output
    name and the rotary node, if ``tensor`` feeds exactly that chain."""
    u = g.only_reader(tensor)
    if g.op(u) != ("", "Unsqueeze"):
        return None
    r = g.only_reader(g.nodes[u].outputs[0])
    if g.op(r) != ("", "RotaryEmbedding") or g.nodes[r].inputs[0] != g.nodes[u].outputs[0]:
        return None
    rot = g.nodes[r]
    if rot.attrs.get("interleaved", 0) or len(rot.inputs) < 4:
        return None
    sq = g.only_reader(rot.outputs[0])
    if g.op(sq) != ("", "Squeeze"):
        return None
    return [u, r, sq], g.nodes[sq].outputs[0], rot


def _fuse_qkv_rotary(g: _Graph, replaced: dict[int, GraphNode | None], axis_values: dict[str, list[int]]) -> int:
    count = 0
    for i, n in enumerate(g.nodes):
        if n.op != ("", "Split") or len(n.outputs) != 3 or i in replaced:
            continue
        q_name, k_name, v_name = n.outputs
        chains = _rotary_chain(g, q_name), _rotary_chain(g, k_name)
        if None in chains:
            continue
        (q_nodes, q_rot, q_rope), (k_nodes, k_rot, k_rope) = chains
        attn_i = g.only_reader(q_rot)
        if g.op(attn_i) != ("trtc", "PagedAttention") or attn_i in replaced:
            continue
        attn = g.nodes[attn_i]
        a = attn.attrs
        heads, kv_heads, head_dim = a["num_heads"], a["num_kv_heads"], a["head_dim"]
        sizes = axis_values.get(n.inputs[1]) if len(n.inputs) > 1 else None
        if (attn.inputs[:3] != [q_rot, k_rot, v_name] or g.only_reader(k_rot) != attn_i
                or g.only_reader(v_name) != attn_i or n.attrs.get("axis", 0) not in (-1, 1)
                or sizes != [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
                or q_rope.inputs[1:4] != k_rope.inputs[1:4]
                or any(axis_values.get(g.nodes[j].inputs[1]) != [0] for j in (q_nodes[0], q_nodes[2], k_nodes[0], k_nodes[2]))
                or q_rope.attrs.get("num_heads") != heads or k_rope.attrs.get("num_heads") != kv_heads
                or q_rope.attrs.get("rotary_embedding_dim", 0) not in (0, head_dim)
                or k_rope.attrs.get("rotary_embedding_dim", 0) not in (0, head_dim)):
            continue
        cos, sin, positions = q_rope.inputs[1:4]
        cache, slot_mapping, block_tables, context_lens, query_start_loc = attn.inputs[3:8]
        replaced[i] = GraphNode(QKV_ROTARY_CACHE_WRITE,
                                [n.inputs[0], cos, sin, positions, cache, slot_mapping], [q_rot], a)
        for j in q_nodes + k_nodes:
            replaced[j] = None
        replaced[attn_i] = GraphNode(PAGED_ATTENTION_CACHED,
                                     [q_rot, cache, block_tables, context_lens, query_start_loc],
                                     attn.outputs, a)
        count += 1
    return count


def _fuse_gemm_swiglu(g: _Graph, replaced: dict[int, GraphNode | None]) -> int:
    count = 0
    for i, n in enumerate(g.nodes):
        a = n.attrs
        if (n.op != ("", "Gemm") or i in replaced or not a.get("transB", 0) or a.get("transA", 0)
                or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0):
            continue
        j = g.only_reader(n.outputs[0])
        if g.op(j) != ("trtc", "SwiGLU") or j in replaced or g.nodes[j].inputs[0] != n.outputs[0]:
            continue
        replaced[i] = GraphNode(GEMM_SWIGLU, n.inputs, g.nodes[j].outputs, a)
        replaced[j] = None
        count += 1
    return count


def _int4_fragments(g: _Graph, replaced: dict[int, GraphNode | None], constants: dict) -> int:
    """Int4Gemm nodes whose fp16 or bf16 weights the fragment kernel takes, on a device that
    runs it: their weights put in its layout (once per weight) and the node rewritten to read
    that. A stored weight, scale or zero tensor leaves ``constants`` as soon as every node that
    reads it reads the fragments instead, so the device holds one layout, and converting a
    model needs one layer's worth of extra memory, not a model's."""
    from trtc.plugins.int4_gemm import fragment_kernel as fk
    takes: dict[int, tuple] = {}
    for i, n in enumerate(g.nodes):
        if n.op != ("trtc", "Int4Gemm") or i in replaced:
            continue
        qweight, scales, zeros = (constants.get(name) for name in n.inputs[1:4])
        a = n.attrs
        if (qweight is None or scales is None or zeros is None
                or scales.dtype not in (torch.float16, torch.bfloat16)
                or not fk.device_supports(qweight.device)
                or fk.fragment_supports(a["out_features"], a["in_features"], a["group_size"])):
            continue
        takes[i] = (*n.inputs[1:4], a["group_size"])
    packed: dict[tuple, tuple[str, str]] = {}
    for i, key in takes.items():
        n = g.nodes[i]
        if key not in packed:
            names = tuple(f"{n.inputs[1]}.fragment{len(packed)}_{part}"
                          for part in ("words", "records"))
            fw = fk.fragment_pack(*(constants[name] for name in key[:3]), key[3])
            constants[names[0]], constants[names[1]] = fw.words, fw.records
            packed[key] = names
            for name in key[:3]:
                if name not in g.graph_outputs and all(takes.get(j) in packed
                                                       for j in g.readers[name]):
                    del constants[name]
        bias = n.inputs[4] if len(n.inputs) > 4 else ""
        replaced[i] = GraphNode(INT4_GEMM_FRAGMENT, [n.inputs[0], bias, *packed[key]], n.outputs,
                                n.attrs)
    return len(takes)


def _largest_linear(model: dict) -> int:
    """Weights of the largest projection of a decoder layer (q/k/v fused, gate/up fused)."""
    h, heads, kv, d, inter = (model[key] for key in ("hidden_size", "num_heads", "num_kv_heads",
                                                     "head_dim", "intermediate_size"))
    return max((heads + 2 * kv) * d * h, h * heads * d, 2 * inter * h, h * inter)


def int4_fragment_bytes(manifest: dict) -> int:
    """What `_int4_fragments` may add to an artifact's device memory, from its manifest (before
    loading it): the fragment layout's larger records, every quantized Linear taken, and the
    transient fp16 weight of the largest projection that a prefill call dequantizes; 0 where
    the rewrite takes none (no INT4, fp32 activations, a group size the kernel does not take)."""
    from trtc.plugins.int4_gemm import fragment_kernel as fk
    quant = manifest.get("quantization", {})
    if (quant.get("bits") != 4 or manifest.get("precision") not in ("fp16", "bf16")
            or quant.get("group_size") not in fk.GROUP_SIZES):
        return 0
    return (fk.fragment_extra_bytes(quant["linear_weight_bytes_quantized"], quant["group_size"])
            + 2 * _largest_linear(manifest["model"]))


def fuse(nodes: list[GraphNode], constants: dict, graph_outputs: set[str],
         int4_fragments: bool = True) -> tuple[list[GraphNode], Counter]:
    """The node list with the patterns above fused, and how many of each were fused.
    ``int4_fragments``: the Int4Gemm layout rewrite (it adds the fragment layout to
    ``constants`` and removes the stored tensors it replaces)."""
    # Axes and split sizes are small integer constants, kept on the host (torch_executor._to_torch).
    axis_values = {k: [int(x) for x in v.reshape(-1).tolist()] for k, v in constants.items()
                   if v.dtype.is_floating_point is False and v.numel() <= 8 and v.device.type == "cpu"}
    g = _Graph(nodes, set(constants), graph_outputs)
    replaced: dict[int, GraphNode | None] = {}
    counts = Counter(qkv_rotary_cache_write=_fuse_qkv_rotary(g, replaced, axis_values),
                     add_rms_norm=_fuse_add_rms_norm(g, replaced),
                     gemm_swiglu=_fuse_gemm_swiglu(g, replaced),
                     int4_fragment=_int4_fragments(g, replaced, constants) if int4_fragments else 0)
    fused = [replaced.get(i, n) for i, n in enumerate(nodes)]
    return [n for n in fused if n is not None], counts
