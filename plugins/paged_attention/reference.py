"""`trtc::PagedAttention` — the semantic definition (torch, CPU).

Every other implementation (Triton kernels, the TensorRT plugin, the TensorRT-RTX lowering)
is tested against this function. It is deliberately plain: one loop over sequences, fp32
math, no tricks.

Semantics for one step of a flattened batch (the step contract, see trtc.contract):

* Tokens of all sequences lie along one axis ``T``. Sequence ``s`` owns tokens
  ``query_start_loc[s] : query_start_loc[s+1]`` (its new tokens: a prefill chunk or one decode
  token). ``context_lens[s]`` is the sequence length *after* this step, so its new tokens sit at
  absolute positions ``context_lens[s] - n_new ... context_lens[s] - 1``.
* First the new keys and values are written into the cache: token ``t`` goes to slot
  ``slot_mapping[t]`` (block ``slot // block_size``, offset ``slot % block_size``). A negative
  slot means padding: nothing is written.
* Then each new token attends causally to every cached position of its sequence up to and
  including its own (``block_tables[s]`` lists the sequence's blocks in order), restricted to
  the last ``sliding_window`` positions when ``sliding_window > 0``. Query head ``h`` reads KV
  head ``h // (num_heads // num_kv_heads)`` (MHA, GQA and MQA alike).
* The updated cache is returned as the second output. It is the *same* tensor as the input
  cache (written in place); in ONNX it is a separate output that TensorRT aliases.
* An FP8 cache (``float8_e4m3fn``) stores ``fp8(k / k_scale)`` and ``fp8(v / v_scale)``
  (saturating at +-448, round to nearest even) and reads back ``stored * k_scale`` /
  ``stored * v_scale``; ``k_scale`` and ``v_scale`` are static per-layer attributes (calibrated at
  build time). For any other cache dtype they must be 1 and the cache holds the values as they are
  (cast to the cache dtype).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What the cache stores for values ``x``: scaled and saturated for FP8, else a plain cast."""
    if dtype == torch.float8_e4m3fn:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def from_cache(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """The fp32 values a cache entry stands for."""
    return stored.float() * scale if stored.dtype == torch.float8_e4m3fn else stored.float()


def check_scales(kv_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    if kv_dtype == torch.float8_e4m3fn:
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(
                f"FP8 KV cache needs positive k_scale and v_scale, got {k_scale}, {v_scale}"
            )
    elif k_scale != 1.0 or v_scale != 1.0:
        raise ValueError(
            f"k_scale/v_scale ({k_scale}, {v_scale}) apply to an FP8 KV cache only; "
            f"this cache is {kv_dtype}"
        )


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter new K/V rows ``[T, KV, D]`` into ``kv_cache[2, blocks, block_size, KV, D]``."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, kv_heads, head_dim)[slots] = to_cache(key[valid], kv_cache.dtype, k_scale)
    kv_cache[1].view(-1, kv_heads, head_dim)[slots] = to_cache(
        value[valid], kv_cache.dtype, v_scale
    )


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[context_len, KV, D]`` of one sequence, in position order."""
    block_size, kv_heads, head_dim = kv_cache.shape[2:]
    num_blocks = -(-context_len // block_size)
    blocks = block_table[:num_blocks].long()
    keys = kv_cache[0, blocks].reshape(-1, kv_heads, head_dim)[:context_len]
    values = kv_cache[1, blocks].reshape(-1, kv_heads, head_dim)[:context_len]
    return keys, values


def causal_mask(
    query_positions: torch.Tensor, context_len: int, sliding_window: int
) -> torch.Tensor:
    """``[n_new, context_len]`` bool: may query at position i see key position j."""
    key_positions = torch.arange(context_len)
    mask = key_positions[None, :] <= query_positions[:, None]
    if sliding_window > 0:
        mask &= key_positions[None, :] > query_positions[:, None] - sliding_window
    return mask


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query ``[T, H*D]``, key/value ``[T, KV*D]``, kv_cache ``[2, blocks, block_size, KV, D]``.

    Returns ``(attn_out [T, H*D] in query's dtype, kv_cache)``.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_scales(kv_cache.dtype, k_scale, v_scale)
    num_tokens = query.shape[0]
    group = num_heads // num_kv_heads
    write_kv(
        kv_cache,
        key.view(num_tokens, num_kv_heads, head_dim),
        value.view(num_tokens, num_kv_heads, head_dim),
        slot_mapping,
        k_scale,
        v_scale,
    )

    q = query.view(num_tokens, num_heads, head_dim).float()
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32)
    starts = query_start_loc.tolist()
    for s, context_len in enumerate(context_lens.tolist()):
        begin, end = starts[s], starts[s + 1]
        n_new = end - begin
        if n_new <= 0:
            continue
        if n_new > context_len:
            raise ValueError(f"sequence {s}: {n_new} new tokens but context_len {context_len}")
        keys, values = gather_context(kv_cache, block_tables[s], context_len)
        keys = from_cache(keys, k_scale).repeat_interleave(group, dim=1)  # [L, H, D]
        values = from_cache(values, v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[begin:end], keys) * scale
        positions = torch.arange(context_len - n_new, context_len)
        mask = causal_mask(positions, context_len, sliding_window)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.to(query.dtype).view(num_tokens, num_heads * head_dim), kv_cache
