"""The step contract: the one I/O definition shared by the exported graph, the plugins, the
manifest and the runtime executors, and `StepInputs`, one step's inputs as tensors.

One call runs one step of an in-flight batch, flattened along the token axis (as vLLM v1 does):
``T`` tokens (prefill chunks, decode tokens and speculative drafts of ``S`` sequences, back to
back) in, ``L`` rows of logits out: the rows of the tokens ``logits_indices`` names, in sequence
order. A sequence usually needs its last token's; one verifying ``k`` drafts needs its last
``k + 1`` tokens' (each row checks the draft after it), and `trtc eval` asks for every token.
The paged KV pool is ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; it is bound
layer by layer (``kv_cache.{i}`` is ``pool[i]``) and each layer's updated cache is an output
that aliases its input, so TensorRT updates it in place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from trtc.artifact import KVCacheLayout

# Symbolic dimensions (the engines' optimisation profiles range over these).
NUM_TOKENS, NUM_SEQS, MAX_BLOCKS, NUM_BLOCKS, NUM_LOGITS = (
    "num_tokens",
    "num_seqs",
    "max_blocks_per_seq",
    "num_blocks",
    "num_logits",
)

STEP_INPUTS = {  # name -> (dtype, shape, meaning)
    "input_ids": ("int64", (NUM_TOKENS,), "token ids of every sequence's new tokens, back to back"),
    "positions": ("int64", (NUM_TOKENS,), "absolute position of each token in its sequence"),
    "slot_mapping": (
        "int64",
        (NUM_TOKENS,),
        "KV slot (block*block_size+offset) each token writes; -1 = none",
    ),
    "block_tables": ("int32", (NUM_SEQS, MAX_BLOCKS), "KV blocks of each sequence, in order"),
    "context_lens": ("int32", (NUM_SEQS,), "length of each sequence after this step"),
    "query_start_loc": (
        "int32",
        ("num_seqs_plus_1",),
        "first token of each sequence, and T at the end",
    ),
    "logits_indices": (
        "int64",
        (NUM_LOGITS,),
        "tokens whose logits are needed, in sequence order: a sequence's last, or its last k+1 "
        "when it verifies k drafts",
    ),
}

TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
}  # fp8: KV cache only (E4M3, scaled per layer)


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


def kv_pool(layout: KVCacheLayout, num_blocks: int, device: torch.device | str) -> torch.Tensor:
    """The paged KV pool ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``, zeroed;
    layer ``i``'s view ``pool[i]`` is bound to ``kv_cache.{i}``."""
    shape = (
        layout.num_layers,
        2,
        num_blocks,
        layout.block_size,
        layout.num_kv_heads,
        layout.head_dim,
    )
    return torch.zeros(shape, dtype=TORCH_DTYPES[layout.dtype], device=device)


def kv_cache_shape(num_kv_heads: int, head_dim: int, block_size: int) -> tuple:
    return (2, NUM_BLOCKS, block_size, num_kv_heads, head_dim)


def step_io(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_dtype: str,
    vocab_size: int,
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    kv_shape = kv_cache_shape(num_kv_heads, head_dim, block_size)
    inputs = [TensorSpec(n, d, s, doc) for n, (d, s, doc) in STEP_INPUTS.items()]
    inputs += [
        TensorSpec(kv_input_name(i), kv_dtype, kv_shape, f"layer {i} of the KV pool")
        for i in range(num_layers)
    ]
    outputs = [
        TensorSpec(
            "logits", "fp32", (NUM_LOGITS, vocab_size), "next-token logits of each logits_indices"
        )
    ]
    outputs += [
        TensorSpec(
            kv_output_name(i), kv_dtype, kv_shape, f"updated {kv_input_name(i)} (aliases it)"
        )
        for i in range(num_layers)
    ]
    return inputs, outputs


def io_manifest(num_layers, num_kv_heads, head_dim, block_size, kv_dtype, vocab_size) -> dict:
    inputs, outputs = step_io(num_layers, num_kv_heads, head_dim, block_size, kv_dtype, vocab_size)
    return {
        "inputs": [t.to_manifest() for t in inputs],
        "outputs": [t.to_manifest() for t in outputs],
        "aliases": {kv_output_name(i): kv_input_name(i) for i in range(num_layers)},
        "kv_pool": {
            "shape": ["layers", 2, NUM_BLOCKS, block_size, num_kv_heads, head_dim],
            "binding": "kv_cache.{i} = pool[i]",
            "dtype": kv_dtype,
        },
    }


@dataclass
class SequenceWork:
    """One sequence's share of a step: its new tokens, how many tokens it already has cached,
    its block table (long enough for ``num_cached + len(new_tokens)`` tokens), and how many of
    its last new tokens need logits (1; k+1 when the last k new tokens are drafts to verify)."""

    new_tokens: list[int]
    num_cached: int
    block_table: list[int]
    num_logits: int = 1


@dataclass
class StepInputs:
    """The step contract's inputs of one step (`STEP_INPUTS`), as host or device tensors."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    def as_dict(self) -> dict[str, torch.Tensor]:
        """By input name, in the contract's order (graph feeds)."""
        return {name: getattr(self, name) for name in STEP_INPUTS}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StepInputs:
        return StepInputs(
            **{k: v.to(device, non_blocking=non_blocking) for k, v in self.as_dict().items()}
        )


def make_step(work: list[SequenceWork], block_size: int) -> StepInputs:
    """Flatten per-sequence work into one step's inputs; each sequence's logits rows are its
    last ``num_logits`` new tokens'."""
    input_ids, positions, slots, starts, context_lens, logits_indices = [], [], [], [0], [], []
    for w in work:
        total = w.num_cached + len(w.new_tokens)
        if len(w.block_table) * block_size < total:
            raise ValueError(
                f"block table of {len(w.block_table)} blocks cannot hold {total} tokens"
            )
        for i, tok in enumerate(w.new_tokens):
            pos = w.num_cached + i
            input_ids.append(tok)
            positions.append(pos)
            slots.append(w.block_table[pos // block_size] * block_size + pos % block_size)
        if not 1 <= w.num_logits <= len(w.new_tokens):
            raise ValueError(
                f"{w.num_logits} logits rows asked of a sequence with "
                f"{len(w.new_tokens)} new tokens"
            )
        starts.append(len(input_ids))
        context_lens.append(total)
        logits_indices.extend(range(len(input_ids) - w.num_logits, len(input_ids)))
    max_blocks = max(len(w.block_table) for w in work)
    tables = [w.block_table + [0] * (max_blocks - len(w.block_table)) for w in work]
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )
