"""The step contract: the one I/O definition shared by the exported graph, the plugins, the
manifest and the runtime executors.

One call runs one step of an in-flight batch, flattened along the token axis (as vLLM v1 does):
``T`` tokens (prefill chunks and decode tokens of ``S`` sequences, back to back) in, one row of
logits per sequence out. The paged KV pool is ``[layers, 2, num_blocks, block_size, kv_heads,
head_dim]``; it is bound layer by layer (``kv_cache.{i}`` is ``pool[i]``) and each layer's
updated cache is an output that aliases its input, so TensorRT updates it in place.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

# Symbolic dimensions (the engines' optimisation profiles range over these).
NUM_TOKENS, NUM_SEQS, MAX_BLOCKS, NUM_BLOCKS = "num_tokens", "num_seqs", "max_blocks_per_seq", "num_blocks"

STEP_INPUTS = {   # name -> (dtype, shape, meaning)
    "input_ids": ("int64", (NUM_TOKENS,), "token ids of every sequence's new tokens, back to back"),
    "positions": ("int64", (NUM_TOKENS,), "absolute position of each token in its sequence"),
    "slot_mapping": ("int64", (NUM_TOKENS,), "KV slot (block*block_size+offset) each token writes; -1 = none"),
    "block_tables": ("int32", (NUM_SEQS, MAX_BLOCKS), "KV blocks of each sequence, in order"),
    "context_lens": ("int32", (NUM_SEQS,), "length of each sequence after this step"),
    "query_start_loc": ("int32", ("num_seqs_plus_1",), "first token of each sequence, and T at the end"),
    "logits_indices": ("int64", (NUM_SEQS,), "token whose logits each sequence needs (its last)"),
}

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                "fp8": torch.float8_e4m3fn}     # fp8: KV cache only (E4M3, scaled per layer)
NUMPY_DTYPES = {"int64": np.int64, "int32": np.int32}


def kv_input_name(layer: int) -> str:
    return f"kv_cache.{layer}"


def kv_output_name(layer: int) -> str:
    return f"kv_cache_out.{layer}"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple
    doc: str = ""

    def to_manifest(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def kv_cache_shape(num_kv_heads: int, head_dim: int, block_size: int) -> tuple:
    return (2, NUM_BLOCKS, block_size, num_kv_heads, head_dim)


def step_io(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
            kv_dtype: str, vocab_size: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    kv_shape = kv_cache_shape(num_kv_heads, head_dim, block_size)
    inputs = [TensorSpec(n, d, s, doc) for n, (d, s, doc) in STEP_INPUTS.items()]
    inputs += [TensorSpec(kv_input_name(i), kv_dtype, kv_shape, f"layer {i} of the KV pool")
               for i in range(num_layers)]
    outputs = [TensorSpec("logits", "fp32", (NUM_SEQS, vocab_size), "next-token logits per sequence")]
    outputs += [TensorSpec(kv_output_name(i), kv_dtype, kv_shape, f"updated {kv_input_name(i)} (aliases it)")
                for i in range(num_layers)]
    return inputs, outputs


def io_manifest(num_layers, num_kv_heads, head_dim, block_size, kv_dtype, vocab_size) -> dict:
    inputs, outputs = step_io(num_layers, num_kv_heads, head_dim, block_size, kv_dtype, vocab_size)
    return {
        "inputs": [t.to_manifest() for t in inputs],
        "outputs": [t.to_manifest() for t in outputs],
        "aliases": {kv_output_name(i): kv_input_name(i) for i in range(num_layers)},
        "kv_pool": {"shape": ["layers", 2, NUM_BLOCKS, block_size, num_kv_heads, head_dim],
                    "binding": "kv_cache.{i} = pool[i]", "dtype": kv_dtype},
    }
