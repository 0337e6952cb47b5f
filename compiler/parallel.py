"""The tensor-parallel layout: how a decoder is split over N ranks, Megatron-style.

Per decoder layer, q/k/v and gate/up are column-parallel (each rank holds a slice of their
output features: its query heads, its KV heads, its intermediate columns), o_proj and down_proj
row-parallel (a slice of their input features, the same heads and columns), and the rank
graph sums the partial results with `trtc::AllReduce`: two all-reduces a layer, nothing else
crosses ranks. Each rank's PagedAttention runs over its own heads and its KV pool holds only
its KV heads. When there are more ranks than KV heads, ranks share a KV head (each holds a copy
of it): rank ``r`` holds KV head ``r // (N / kv_heads)``, the one its query heads use.

The embedding and the LM head are replicated: every rank computes the full logits, so no
gather is needed (the head is a twelfth of an 8B model's bytes; a vocab-parallel head with a
gathered output is the alternative, to be measured on several GPUs). Norms are replicated.

Everything here is arithmetic on the geometry: `check_tensor_parallel` runs before any weight
is read, `rank_geometry` is what each rank's graph is exported with, and `tensor_slice` says
which part of a checkpoint tensor a rank holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trtc.artifact import ModelGeometry
from trtc.errors import ConfigError

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
REPLICATED = ("embed_tokens", "lm_head", "norms")
_PROJECTION = re.compile(r"\.(self_attn|mlp)\.(\w+_proj)\.(\w+)$")
# A row-parallel INT4 Linear's tensors, and how many input features one column of each holds.
_ROW_SPLIT_PER_COLUMN = {"weight": 1, "qweight": 2}  # qweight packs two 4-bit values a byte
_ROW_SPLIT_PER_GROUP = ("scales", "zeros")


@dataclass(frozen=True)
class RankShard:
    """What rank ``rank`` of ``world_size`` holds, as ``[start, stop)`` ranges."""

    rank: int
    world_size: int
    heads: tuple[int, int]  # query heads
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]  # columns of gate/up (rows of down_proj's input)

    def record(self) -> dict[str, list[int]]:
        return {
            "heads": list(self.heads),
            "kv_heads": list(self.kv_heads),
            "intermediate": list(self.intermediate),
        }


def check_tensor_parallel(
    n: int, g: ModelGeometry, quant_method: str = "none", group_size: int | None = None
) -> None:
    """Refuse, in one line naming ``parallel.tensor``, a split this model cannot take."""
    if n == 1:
        return
    dividing = [str(d) for d in (1, 2, 4, 8) if _splits(d, g)]
    hint = f" (this model splits over {', '.join(dividing)} ranks)"
    if g.num_heads % n:
        raise ConfigError(
            f"parallel.tensor: {n} does not divide the model's {g.num_heads} query heads "
            f"(num_attention_heads){hint}"
        )
    if g.intermediate_size % n:
        raise ConfigError(
            f"parallel.tensor: {n} does not divide the model's intermediate_size "
            f"{g.intermediate_size}{hint}"
        )
    if g.num_kv_heads % n and n % g.num_kv_heads:
        raise ConfigError(
            f"parallel.tensor: the model's {g.num_kv_heads} KV heads neither divide by {n} nor "
            f"divide {n} (to be replicated){hint}"
        )
    if quant_method in ("rtn", "awq", "gptq"):
        # A row-parallel rank's input features must be whole INT4 groups.
        widths = {
            "query heads * head_dim": g.num_heads // n * g.head_dim,
            "intermediate_size": g.intermediate_size // n,
        }
        bad = {k: v for k, v in widths.items() if v % group_size}
        if bad:
            raise ConfigError(
                f"parallel.tensor: {n} ranks give o_proj/down_proj "
                + ", ".join(f"{v} input features per rank ({k} / {n})" for k, v in bad.items())
                + f", not whole INT4 groups of {group_size}; choose a smaller "
                "quantization.group_size or fewer ranks"
            )


def _splits(n: int, g: ModelGeometry) -> bool:
    return (
        g.num_heads % n == 0
        and g.intermediate_size % n == 0
        and (g.num_kv_heads % n == 0 or n % g.num_kv_heads == 0)
    )


def rank_geometry(g: ModelGeometry, n: int) -> ModelGeometry:
    """The geometry one rank's graph is built with: its share of the heads and columns."""
    if n == 1:
        return g
    return g.model_copy(
        update={
            "num_heads": g.num_heads // n,
            "num_kv_heads": max(1, g.num_kv_heads // n),
            "intermediate_size": g.intermediate_size // n,
        }
    )


def rank_shard(g: ModelGeometry, n: int, rank: int) -> RankShard:
    heads = g.num_heads // n
    if g.num_kv_heads >= n:
        kv = g.num_kv_heads // n
        kv_start = rank * kv
    else:  # ranks share a KV head: the one their query heads use
        kv, kv_start = 1, rank // (n // g.num_kv_heads)
    cols = g.intermediate_size // n
    return RankShard(
        rank,
        n,
        (rank * heads, (rank + 1) * heads),
        (kv_start, kv_start + kv),
        (rank * cols, (rank + 1) * cols),
    )


def tensor_slice(
    name: str, shard: RankShard, g: ModelGeometry, group_size: int | None = None
) -> tuple[int, int, int, int] | None:
    """``(dim, start, stop, whole)``: the part ``[start, stop)`` of dimension ``dim`` of
    checkpoint tensor ``name`` (or of a quantized Linear's tensor of that name) that rank
    ``shard`` holds, and the size ``whole`` the config gives that dimension; None for a tensor
    every rank holds whole. ``group_size``: the INT4 group of quantized Linears."""
    match = _PROJECTION.search(name)
    if match is None:
        return None  # embedding, LM head, norms (q_norm/k_norm are over head_dim: whole)
    _, proj, leaf = match.groups()
    d = g.head_dim
    if proj in COLUMN_PARALLEL:
        if leaf == "input_scale":  # FP8: one activation scale per Linear
            return None
        start, stop, whole = {
            "q_proj": (shard.heads[0] * d, shard.heads[1] * d, g.num_heads * d),
            "k_proj": (shard.kv_heads[0] * d, shard.kv_heads[1] * d, g.num_kv_heads * d),
            "v_proj": (shard.kv_heads[0] * d, shard.kv_heads[1] * d, g.num_kv_heads * d),
            "gate_proj": (*shard.intermediate, g.intermediate_size),
            "up_proj": (*shard.intermediate, g.intermediate_size),
        }[proj]
        return 0, start, stop, whole
    if proj in ROW_PARALLEL:
        start, stop, whole = (
            (shard.heads[0] * d, shard.heads[1] * d, g.num_heads * d)
            if proj == "o_proj"
            else (*shard.intermediate, g.intermediate_size)
        )
        if leaf in _ROW_SPLIT_PER_COLUMN:
            per = _ROW_SPLIT_PER_COLUMN[leaf]
            return 1, start // per, stop // per, whole // per
        if leaf in _ROW_SPLIT_PER_GROUP:
            return 1, start // group_size, stop // group_size, -(-whole // group_size)
        return None  # bias (added once, after the sum), FP8 per-row and input scales
    raise ValueError(f"{name}: a projection trtc does not split ({proj})")


def layout_record(g: ModelGeometry, n: int) -> dict:
    """The manifest's ``parallel`` section."""
    return {
        "tensor": n,
        "ranks": [rank_shard(g, n, r).record() for r in range(n)],
        "column_parallel": list(COLUMN_PARALLEL),
        "row_parallel": list(ROW_PARALLEL),
        "replicated": list(REPLICATED),
        "kv_heads_replicated": g.num_kv_heads < n,
    }
