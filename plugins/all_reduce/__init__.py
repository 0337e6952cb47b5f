"""The `trtc::AllReduce` plugin: the sum of a tensor over the tensor-parallel group.

A tensor-parallel rank graph ends each row-parallel projection (attention's o_proj, the MLP's
down_proj) with this node: every rank holds a partial product over its slice of the input
features, and the sum over the ranks is the full projection. The bias, if the projection has
one, is added once, after the sum (each rank adding it would count it N times).

The group is the process's tensor-parallel group, set once by the runtime (`use_group`) before
a rank graph runs: torch.distributed over NCCL for CUDA tensors, gloo for CPU tensors. The
TensorRT plugin wrapper calls the same entry point on TensorRT's stream, so the engine's
all-reduce is NCCL's, as TensorRT-LLM's AllReduce plugin is.
"""

from __future__ import annotations

import torch

from trtc.plugins.spec import PluginSpec

SPEC = PluginSpec(
    op_type="AllReduce",
    version=1,
    inputs=("x", "bias"),
    outputs=("y",),
    attributes={"world_size": int},
    doc="y = sum of x over the world_size ranks of the tensor-parallel group (in x's dtype), "
    "plus bias [N] once if given; every rank gets the same y",
)

_group = None  # torch.distributed ProcessGroup of this process's tensor-parallel ranks


def use_group(group) -> None:
    """Make ``group`` (a torch.distributed process group, or None to forget it) the one
    every AllReduce node of this process sums over."""
    global _group
    _group = group


def all_reduce(x: torch.Tensor, bias: torch.Tensor | None = None, *, world_size: int):
    """Under ONNX export: one plugin node (without ``bias`` if None). Eager: the sum over the
    group set by `use_group` (torch.distributed: NCCL on CUDA tensors, gloo on CPU ones)."""
    attrs = {"world_size": int(world_size)}
    if torch.onnx.is_in_onnx_export():
        return SPEC.export((x, bias), attrs, (x.dtype, x.shape))
    import torch.distributed as dist

    if _group is None:
        raise RuntimeError(
            f"trtc::AllReduce over {world_size} ranks, but this process joined no "
            "tensor-parallel group (a rank graph runs only in a tensor-parallel worker)"
        )
    size = dist.get_world_size(_group)
    if size != world_size:
        raise RuntimeError(
            f"trtc::AllReduce over {world_size} ranks, but the process group has {size}"
        )
    y = x.contiguous().clone()  # the node's output is its own tensor, as in the engine
    dist.all_reduce(y, group=_group)
    if bias is not None:
        y += bias.to(y.dtype)
    return y


__all__ = ["SPEC", "all_reduce", "use_group"]
