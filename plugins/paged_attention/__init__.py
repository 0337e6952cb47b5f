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
)


def paged_attention(
    query,
    key,
    value,
    kv_cache,
    slot_mapping,
    block_tables,
    context_lens,
    query_start_loc,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """Under ONNX export: one plugin node. Eager: the Triton kernels on CUDA tensors, the torch
    reference on CPU (both write ``kv_cache`` in place)."""
    attrs = dict(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        scale=float(scale),
        sliding_window=sliding_window,
        k_scale=float(k_scale),
        v_scale=float(v_scale),
    )
    if torch.onnx.is_in_onnx_export():
        out, cache = torch.onnx.ops.symbolic_multi_out(
            SPEC.qualified_name,
            [
                query,
                key,
                value,
                kv_cache,
                slot_mapping,
                block_tables,
                context_lens,
                query_start_loc,
            ],
            attrs,
            dtypes=(query.dtype, kv_cache.dtype),
            shapes=(query.shape, kv_cache.shape),
            version=SPEC.version,
        )
        return out, cache
    if query.is_cuda:
        from trtc.plugins.paged_attention.triton_kernels import paged_attention as on_gpu

        return on_gpu(
            query,
            key,
            value,
            kv_cache,
            slot_mapping,
            block_tables,
            context_lens,
            query_start_loc,
            **attrs,
        )
    return reference(
        query,
        key,
        value,
        kv_cache,
        slot_mapping,
        block_tables,
        context_lens,
        query_start_loc,
        **attrs,
    )
