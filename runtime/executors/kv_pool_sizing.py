"""How much the CUDA executor captures and what memory its KV pool gets: the sizes of the decode
and prefill / mixed-step graphs, and the KV blocks left for the pool after the weights, their
fragment-layout copies and what those graphs hold."""

from __future__ import annotations

import torch

from trtc.artifact import Limits, Manifest
from trtc.runtime.executors.fusions.int4_fragment import int4_fragment_bytes

# Batch sizes of the decode graphs (`decode_graph_sizes`).
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Token counts of the prefill / mixed-step graphs (those above the largest decode batch and at
# most the artifact's step limit are captured): a step runs in the smallest bucket that holds
# it, so padding costs at most a third of its tokens above 128.
MIXED_TOKEN_BUCKETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def blocks_for_memory(
    manifest: Manifest, memory_fraction: float, device: torch.device, weight_bytes: int
) -> int:
    """KV blocks that fit in ``memory_fraction`` of the GPU, after the weights and a margin for
    activations."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * memory_fraction) - (total - free) - weight_bytes - (1 << 30)
    blocks = budget // manifest.kv_cache.bytes_per_block
    if blocks < 1:
        raise RuntimeError(
            f"no GPU memory left for the KV cache ({budget / 2**30:.1f} GiB after the weights)"
        )
    return int(blocks)


def decode_graph_sizes(limits: Limits, max_graph_batch: int | None = None) -> list[int]:
    """The batch sizes decode graphs are captured for: `GRAPH_BATCH_SIZES` up to the largest
    (``max_graph_batch``, at most the artifact's ``max_num_seqs``), which is always one."""
    top = min(max_graph_batch or limits.max_num_seqs, limits.max_num_seqs)
    sizes = [b for b in GRAPH_BATCH_SIZES if b <= top] or [1]
    return sizes if sizes[-1] == top else [*sizes, top]


def mixed_graph_seqs(decode_batch: int) -> int:
    """The sequences of a prefill / mixed-step graph: every sequence a step may run (the
    largest decode batch) and the padding one (`MixedStepInputs`). A step at full concurrency
    (a new prompt's chunk beside every other running sequence's token) is the common one."""
    return decode_batch + 1


def mixed_token_buckets(limits: Limits, seqs: int) -> list[int]:
    """The token buckets of the prefill / mixed-step graphs over ``seqs`` sequences: more
    tokens than sequences (a prefill launch), at most a step's and a context's."""
    top = min(limits.max_num_tokens, limits.max_seq_len)
    return [t for t in MIXED_TOKEN_BUCKETS if seqs < t <= top]


def mixed_graph_bytes(manifest: Manifest, tokens: int, seqs: int) -> int:
    """About what the prefill / mixed-step graphs hold on top of the eager margin: their
    shared pool (the largest bucket's activations: a layer's gate and up projections and their
    product, the residual stream, normed and attention copies, per token) and their shared
    ``[seqs, vocab]`` fp32 logits (and the half-precision logits they are made from)."""
    g = manifest.model
    element = 4 if manifest.precision == "fp32" else 2
    activations = tokens * (3 * g.intermediate_size + 6 * g.hidden_size) * element
    return activations + seqs * g.vocab_size * (4 + element)


def pool_blocks(
    manifest: Manifest,
    device: str | torch.device = "cuda",
    memory_fraction: float = 0.9,
    int4_fragments: bool = True,
    mixed_graphs: bool = True,
) -> int:
    """The KV blocks a pool on ``device`` gets by default: what ``memory_fraction`` of
    the GPU holds after the weights (and their fragment-layout copies) and, with
    ``mixed_graphs``, what the prefill / mixed-step graphs hold."""
    weight_bytes = manifest.graph.weight_bytes["total"]
    if int4_fragments:
        weight_bytes += int4_fragment_bytes(manifest)
    seqs = mixed_graph_seqs(decode_graph_sizes(manifest.limits)[-1])
    buckets = mixed_token_buckets(manifest.limits, seqs) if mixed_graphs else []
    if buckets:
        weight_bytes += mixed_graph_bytes(manifest, buckets[-1], seqs)
    return blocks_for_memory(manifest, memory_fraction, torch.device(device), weight_bytes)
