"""The `trtc::PagedAttention` plugin: its ONNX signature and the torch entry point."""

from __future__ import annotations

import torch

from trtc.plugins.paged_attention.reference import paged_attention as reference
from trtc.plugins.spec import PluginSpec

SPEC = PluginSpec(
    op_type="PagedAttention",
    version=1,
    inputs=(
        "query",
        "key",
        "value",
        "kv_cache",
        "slot_mapping",
        "block_tables",
        "context_lens",
        "query_start_loc",
    ),
    outputs=("attn_out", "kv_cache_out"),
    attributes={
        "num_heads": int,
        "num_kv_heads": int,
        "head_dim": int,
        "scale": float,
        "sliding_window": int,
        "k_scale": float,
        "v_scale": float,
    },
    aliases={"kv_cache_out": "kv_cache"},
    doc="causal attention over the paged KV cache for a flattened batch of prefill chunks "
    "and decode tokens; writes the new K/V into their slots; an FP8 (E4M3) cache stores "
    "k / k_scale and v / v_scale (saturating) and reads back stored * scale, other caches "
    "take k_scale = v_scale = 1",
    defaults={"sliding_window": 0, "k_scale": 1.0, "v_scale": 1.0},
)


def paged_attention(
    query, key, value, kv_cache, slot_mapping, block_tables, context_lens, query_start_loc, **attrs
):
    """Under ONNX export: one plugin node. Eager: the Triton kernels on CUDA tensors, the torch
    reference on CPU (both write ``kv_cache`` in place). ``attrs``: the attributes of `SPEC`,
    keywords as the reference names them (``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``scale``; ``sliding_window``, ``k_scale`` and ``v_scale`` may be left out)."""
    attrs = SPEC.attribute_values(attrs)
    inputs = query, key, value, kv_cache, slot_mapping, block_tables, context_lens, query_start_loc
    if torch.onnx.is_in_onnx_export():
        return SPEC.export(
            inputs, attrs, (query.dtype, query.shape), (kv_cache.dtype, kv_cache.shape)
        )
    if query.is_cuda:
        from trtc.plugins.paged_attention.triton_kernels import paged_attention as on_gpu

        return on_gpu(*inputs, **attrs)
    return reference(*inputs, **attrs)
