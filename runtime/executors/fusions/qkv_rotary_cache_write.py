"""``Split(qkv) -> [Unsqueeze -> RotaryEmbedding -> Squeeze] x2 -> PagedAttention`` as
``QKVRotaryCacheWrite`` (rotate q; rotate k and write it and v into their cache slots) followed
by ``PagedAttentionCached`` (the plugin's attention over a cache that already holds the new
tokens). Two rotary kernels, the copies of the strided q/k/v slices and the plugin's own
cache-write kernel collapse into one. A pattern that does not match exactly (other readers of an
intermediate, other attributes) is left as it is: so is a Qwen3 layer, whose per-head q/k
RMSNorm sits between the Split and the rotary (the Split's only reader must be the Unsqueeze),
since the kernel does not compute that norm."""

from __future__ import annotations

from dataclasses import dataclass

from trtc.plugins.paged_attention import SPEC as PAGED_ATTENTION
from trtc.runtime.executors.graph import RUNTIME_DOMAIN, Fusion, GraphNode, NodeGraph

QKV_ROTARY_CACHE_WRITE = (RUNTIME_DOMAIN, "QKVRotaryCacheWrite")
PAGED_ATTENTION_CACHED = (RUNTIME_DOMAIN, "PagedAttentionCached")


def qkv_rotary_cache_write(x, attrs):
    qkv, cos, sin, positions, kv_cache, slot_mapping = x
    from trtc.plugins.kernels import pointwise

    return [
        pointwise.qkv_rotary_write(
            qkv,
            cos,
            sin,
            positions,
            kv_cache,
            slot_mapping,
            attrs["num_heads"],
            attrs["num_kv_heads"],
            attrs.get("k_scale", 1.0),
            attrs.get("v_scale", 1.0),
        )
    ]


def paged_attention_cached(x, attrs):
    query, kv_cache, block_tables, context_lens, query_start_loc = x
    from trtc.plugins.paged_attention.triton_kernels import paged_attention

    out, cache = paged_attention(
        query,
        None,
        None,
        kv_cache,
        None,
        block_tables,
        context_lens,
        query_start_loc,
        **PAGED_ATTENTION.attribute_values(attrs),
        write_kv=False,
    )
    return [out, cache]


@dataclass
class _RotaryChain:
    """``tensor -> Unsqueeze(0) -> RotaryEmbedding -> Squeeze(0)``."""

    nodes: list[int]  # unsqueeze, rotary, squeeze
    output: str
    rotary: GraphNode


def _rotary_chain(g: NodeGraph, tensor: str) -> _RotaryChain | None:
    u = g.only_reader(tensor)
    if g.op(u) != ("", "Unsqueeze"):
        return None
    r = g.only_reader(g.original[u].outputs[0])
    if g.op(r) != ("", "RotaryEmbedding") or g.original[r].inputs[0] != g.original[u].outputs[0]:
        return None
    rot = g.original[r]
    if rot.attrs.get("interleaved", 0) or len(rot.inputs) < 4:
        return None
    sq = g.only_reader(rot.outputs[0])
    if g.op(sq) != ("", "Squeeze"):
        return None
    unsqueeze, squeeze = g.original[u], g.original[sq]
    if g.int_values(unsqueeze.inputs[1]) != [0] or g.int_values(squeeze.inputs[1]) != [0]:
        return None
    return _RotaryChain([u, r, sq], squeeze.outputs[0], rot)


def _rotates_whole_heads(rotary: GraphNode, heads: int, head_dim: int) -> bool:
    a = rotary.attrs
    return a.get("num_heads") == heads and a.get("rotary_embedding_dim", 0) in (0, head_dim)


def _splits_qkv(g: NodeGraph, split: GraphNode, attn: GraphNode) -> bool:
    """``split`` cuts the merged projection into q, k and v of ``attn``'s head counts."""
    a = attn.attrs
    q, kv = a["num_heads"] * a["head_dim"], a["num_kv_heads"] * a["head_dim"]
    sizes = g.int_values(split.inputs[1]) if len(split.inputs) > 1 else None
    return split.attrs.get("axis", 0) in (-1, 1) and sizes == [q, kv, kv]


def fuse_qkv_rotary(g: NodeGraph) -> int:
    count = 0
    for i, n in enumerate(g.original):
        if n.op != ("", "Split") or len(n.outputs) != 3 or not g.free(i):
            continue
        q_name, k_name, v_name = n.outputs
        q, k = _rotary_chain(g, q_name), _rotary_chain(g, k_name)
        if q is None or k is None:
            continue
        attn_i = g.only_reader(q.output)
        if g.op(attn_i) != ("trtc", "PagedAttention") or not g.free(attn_i):
            continue
        attn = g.original[attn_i]
        a = attn.attrs
        wired = (
            attn.inputs[:3] == [q.output, k.output, v_name]
            and g.only_reader(k.output) == attn_i
            and g.only_reader(v_name) == attn_i
        )
        same_tables = q.rotary.inputs[1:4] == k.rotary.inputs[1:4]  # cos, sin, positions
        if not (
            wired
            and same_tables
            and _splits_qkv(g, n, attn)
            and _rotates_whole_heads(q.rotary, a["num_heads"], a["head_dim"])
            and _rotates_whole_heads(k.rotary, a["num_kv_heads"], a["head_dim"])
        ):
            continue
        cos, sin, positions = q.rotary.inputs[1:4]
        cache, slot_mapping, block_tables, context_lens, query_start_loc = attn.inputs[3:8]
        g.replace(
            i,
            GraphNode(
                QKV_ROTARY_CACHE_WRITE,
                [n.inputs[0], cos, sin, positions, cache, slot_mapping],
                [q.output],
                a,
            ),
        )
        g.remove(*q.nodes, *k.nodes)
        g.replace(
            attn_i,
            GraphNode(
                PAGED_ATTENTION_CACHED,
                [q.output, cache, block_tables, context_lens, query_start_loc],
                attn.outputs,
                a,
            ),
        )
        count += 1
    return count


FUSION = Fusion(
    "qkv_rotary_cache_write",
    {
        QKV_ROTARY_CACHE_WRITE: qkv_rotary_cache_write,
        PAGED_ATTENTION_CACHED: paged_attention_cached,
    },
    fuse_qkv_rotary,
)
