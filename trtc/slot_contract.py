"""The slot step contract: the I/O of TensorRT-RTX engines.

TensorRT-RTX takes no custom plugins, so its engines cannot use the paged KV pool of
`trtc.contract`. They use TensorRT's native KV-cache update (``TRT_KVCacheUpdate`` /
IKVCacheUpdateLayer, linear mode), which writes into a **contiguous cache per slot**:
``k_cache.{i}`` and ``v_cache.{i}`` are ``[batch, kv_heads, max_seq_len, head_dim]`` and row ``b``
holds the keys/values of the sequence that occupies slot ``b``, position by position.

One call runs one step for ``B`` slots, each with up to ``S`` new tokens, padded on the right:

* ``input_ids[b, :n_b]`` are slot ``b``'s new tokens (a prefill chunk or one decode token); the
  rest of the row is padding (any valid token id, 0 is fine). Idle slots are all padding.
* ``cache_positions[b]`` is the number of tokens slot ``b`` already has cached. New token ``s``
  has position ``cache_positions[b] + s`` and is written to cache row ``cache_positions[b] + s``.
  Positions are derived in the graph from it, so they can never disagree with the cache.
* Token ``s`` of slot ``b`` attends to cache rows ``j <= cache_positions[b] + s`` (and
  ``j > cache_positions[b] + s - sliding_window`` on sliding-window layers).
* ``logits_indices[b]`` indexes the flattened token axis ``b * S + s`` (as in the paged
  contract): the token whose logits slot ``b`` needs, its last new one.

Rules the runtime keeps:

* ``cache_positions[b] + S <= max_seq_len`` for every row, padding included (TensorRT's bound
  for the update; padding rows are written too). A slot close to ``max_seq_len`` must not share
  a step with a long prefill chunk.
* Padding writes land at rows ``>= cache_positions[b] + n_b``, past the slot's valid data, and
  are overwritten by the slot's next tokens before any query can see them.
* Caches start zeroed: masked rows are multiplied by a zero weight, and uninitialised memory may
  hold NaN (``0 * NaN = NaN``).
* The ``B`` rows bound in a call are the first ``B`` rows of the runtime's
  ``[max_num_seqs, kv_heads, max_seq_len, head_dim]`` buffers (a contiguous prefix view); each
  updated cache is an output that aliases its input, so TensorRT updates it in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trtc.artifact import Manifest
from trtc.contract import TensorSpec

# Symbolic dimensions (the engine's optimisation profile ranges over these).
BATCH, NEW_TOKENS = "batch", "new_tokens"
KV_LAYOUT = "slot"

SLOT_INPUTS = {  # name -> (dtype, shape, meaning)
    "input_ids": (
        "int64",
        (BATCH, NEW_TOKENS),
        "new tokens of each slot, left-aligned; padding after them (any valid id)",
    ),
    "cache_positions": (
        "int32",
        (BATCH,),
        "tokens already cached for the slot = position and cache row of its first new token",
    ),
    "logits_indices": (
        "int64",
        (BATCH,),
        "flat token index b*new_tokens+s whose logits each slot needs (its last new token)",
    ),
}


def k_cache_name(layer: int) -> str:
    return f"k_cache.{layer}"


def v_cache_name(layer: int) -> str:
    return f"v_cache.{layer}"


def k_cache_out_name(layer: int) -> str:
    return f"k_cache_out.{layer}"


def v_cache_out_name(layer: int) -> str:
    return f"v_cache_out.{layer}"


def cache_shape(num_kv_heads: int, head_dim: int, max_seq_len: int) -> tuple:
    return (BATCH, num_kv_heads, max_seq_len, head_dim)


@dataclass(frozen=True)
class SlotContract:
    """The slot contract of one model: everything else (lowering, engine profile, manifest,
    executor bindings) derives its names, dtypes and shapes from here."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    kv_dtype: str
    vocab_size: int

    @classmethod
    def from_manifest(cls, manifest: Manifest, max_seq_len: int | None = None) -> SlotContract:
        g, kv = manifest.model, manifest.kv_cache
        return cls(
            num_layers=g.num_layers,
            num_kv_heads=g.num_kv_heads,
            head_dim=g.head_dim,
            max_seq_len=max_seq_len or manifest.limits.max_seq_len,
            kv_dtype=kv.dtype,
            vocab_size=g.vocab_size,
        )

    @property
    def cache_shape(self) -> tuple:
        return cache_shape(self.num_kv_heads, self.head_dim, self.max_seq_len)

    def aliases(self) -> dict[str, str]:
        out = {}
        for i in range(self.num_layers):
            out[k_cache_out_name(i)] = k_cache_name(i)
            out[v_cache_out_name(i)] = v_cache_name(i)
        return out

    def inputs(self) -> list[TensorSpec]:
        specs = [TensorSpec(n, d, s, doc) for n, (d, s, doc) in SLOT_INPUTS.items()]
        for i in range(self.num_layers):
            specs.append(
                TensorSpec(
                    k_cache_name(i),
                    self.kv_dtype,
                    self.cache_shape,
                    f"layer {i} keys, one row per slot",
                )
            )
            specs.append(
                TensorSpec(
                    v_cache_name(i),
                    self.kv_dtype,
                    self.cache_shape,
                    f"layer {i} values, one row per slot",
                )
            )
        return specs

    def outputs(self) -> list[TensorSpec]:
        specs = [
            TensorSpec("logits", "fp32", (BATCH, self.vocab_size), "next-token logits per slot")
        ]
        for out, src in self.aliases().items():
            specs.append(
                TensorSpec(out, self.kv_dtype, self.cache_shape, f"updated {src} (aliases it)")
            )
        return specs

    def bytes_per_slot(self) -> int:
        itemsize = {"fp32": 4, "fp16": 2, "bf16": 2}[self.kv_dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.max_seq_len * self.head_dim * itemsize

    def to_manifest(self) -> dict:
        return {
            "kv_layout": KV_LAYOUT,
            "inputs": [t.to_manifest() for t in self.inputs()],
            "outputs": [t.to_manifest() for t in self.outputs()],
            "aliases": self.aliases(),
            "kv_cache": {
                "layout": KV_LAYOUT,
                "dtype": self.kv_dtype,
                "shape": [BATCH, self.num_kv_heads, self.max_seq_len, self.head_dim],
                "binding": "k_cache.{i} / v_cache.{i} = rows 0..batch-1 of layer i's slot buffers",
                "max_seq_len": self.max_seq_len,
                "bytes_per_slot": self.bytes_per_slot(),
            },
            "rules": [
                "position of new token s of slot b = cache_positions[b] + s",
                "cache_positions[b] + new_tokens <= max_seq_len for every row (padding included)",
                "padding tokens follow a slot's new tokens; their writes are overwritten before "
                "they are visible",
                "caches start zeroed",
            ],
        }


@dataclass
class SlotWork:
    """One slot's share of a step: its new tokens and how many tokens it already has cached."""

    new_tokens: list[int]
    num_cached: int


def make_slot_step(
    work: list[SlotWork], max_seq_len: int | None = None, num_new_tokens: int | None = None
) -> dict[str, np.ndarray]:
    """The step inputs for ``work[b]`` in slot row ``b`` (empty ``new_tokens`` = idle slot).
    ``num_new_tokens`` pads the token axis beyond the longest row (default: no extra padding)."""
    width = max([len(w.new_tokens) for w in work] + [1, num_new_tokens or 0])
    ids = np.zeros((len(work), width), np.int64)
    cache_positions = np.zeros(len(work), np.int32)
    logits_indices = np.zeros(len(work), np.int64)
    for b, w in enumerate(work):
        if max_seq_len is not None and w.num_cached + width > max_seq_len:
            raise ValueError(
                f"slot {b}: {w.num_cached} cached + {width} new tokens exceed "
                f"max_seq_len {max_seq_len} (split the step)"
            )
        ids[b, : len(w.new_tokens)] = w.new_tokens
        cache_positions[b] = w.num_cached
        logits_indices[b] = b * width + max(len(w.new_tokens) - 1, 0)
    return {"input_ids": ids, "cache_positions": cache_positions, "logits_indices": logits_indices}
