"""Weights as recipes: the graph is exported and rewritten without them, and each weight is
produced (read, converted, concatenated, quantized) only when the artifact's data file is
written, one tensor at a time.

A `LazyWeight` is an onnx-graphsurgeon constant value: the passes see its shape and dtype, and
a fusion that concatenates weights (merged q/k/v, gate/up) concatenates recipes (`concat`).
The exported graph carries a placeholder initializer per weight (external data at a location
no file has) that `compiler.writer.save_onnx` replaces with the bytes and their offset.

`plan_weights` names the recipe of every tensor of the step model: the source's tensor cast to
the build precision, or the tensors of a quantized Linear's plugin module.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch
from onnx_graphsurgeon.ir.tensor import LazyValues

from trtc.compiler.checkpoint import WeightSource
from trtc.errors import BuildError

# The placeholder's external-data location: no file of that name is ever written.
PENDING = "trtc-pending-weight"
_KEY = "trtc_weight"  # external_data key holding the recipe's id

TORCH_TO_ONNX = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.float8_e4m3fn: onnx.TensorProto.FLOAT8E4M3FN,
    torch.uint8: onnx.TensorProto.UINT8,
    torch.int8: onnx.TensorProto.INT8,
    torch.int32: onnx.TensorProto.INT32,
    torch.int64: onnx.TensorProto.INT64,
}
_ids = itertools.count()


class LazyWeight(LazyValues):
    """A constant's values, produced on demand by ``produce() -> torch.Tensor``.

    Not built from a TensorProto as onnx-graphsurgeon's LazyValues is: ``tensor`` is the
    placeholder the graph exports (graphsurgeon exports a LazyValues' ``tensor`` as it is,
    without loading it)."""

    loaded_bytes = 0  # bytes materialised through `load` (passes should need none: tests check)

    def __init__(
        self, shape: Sequence[int], dtype: torch.dtype, produce: Callable[[], torch.Tensor]
    ):
        self.shape = tuple(int(d) for d in shape)
        self.torch_dtype = dtype
        self.onnx_dtype = TORCH_TO_ONNX[dtype]
        self.dtype = onnx.helper.tensor_dtype_to_np_dtype(self.onnx_dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * dtype.itemsize
        self._produce = produce
        self.id = str(next(_ids))
        self.tensor = onnx.TensorProto(dims=self.shape, data_type=self.onnx_dtype)
        self.tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", PENDING), (_KEY, self.id)):
            entry = self.tensor.external_data.add()
            entry.key, entry.value = key, value

    def materialize(self) -> torch.Tensor:
        t = self._produce()
        if tuple(t.shape) != self.shape or t.dtype != self.torch_dtype:
            raise RuntimeError(
                f"weight {self.tensor.name or self.id}: recipe produced {tuple(t.shape)} "
                f"{t.dtype}, the graph expects {self.shape} {self.torch_dtype}"
            )
        return t.contiguous()

    def load(self) -> np.ndarray:
        """The values as numpy (what graphsurgeon calls when a pass reads ``.values``)."""
        LazyWeight.loaded_bytes += self.nbytes
        t = self.materialize()
        return t.view(torch.uint8).numpy().view(self.dtype).reshape(self.shape).copy()

    def __repr__(self) -> str:
        return f"LazyWeight(shape={self.shape}, dtype={self.torch_dtype})"


def _pending(tensor: onnx.TensorProto) -> dict[str, str] | None:
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    entries = {e.key: e.value for e in tensor.external_data}
    return entries if entries.get("location") == PENDING else None


def weight_id(tensor: onnx.TensorProto) -> str | None:
    """The recipe id of a bound placeholder initializer, None for any other tensor."""
    return (_pending(tensor) or {}).get(_KEY)


def is_placeholder(tensor: onnx.TensorProto) -> bool:
    return _pending(tensor) is not None


def _as_torch(value: np.ndarray | LazyWeight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, LazyWeight):
        return value.materialize()
    # Through bytes: numpy's bfloat16 (ml_dtypes) has no torch.from_numpy.
    array = np.ascontiguousarray(value)
    return (
        torch.from_numpy(array.reshape(-1).view(np.uint8).copy()).view(dtype).reshape(array.shape)
    )


def _first_recipe(values) -> LazyWeight | None:
    return next((v for v in values if isinstance(v, LazyWeight)), None)


def concat(values: Sequence[np.ndarray | LazyWeight], axis: int = 0) -> np.ndarray | LazyWeight:
    """``np.concatenate`` over values any of which may be recipes (then a recipe too)."""
    first = _first_recipe(values)
    if first is None:
        return np.concatenate(values, axis)
    shape = list(first.shape)
    shape[axis] = sum(v.shape[axis] for v in values)
    parts, dtype = list(values), first.torch_dtype
    return LazyWeight(shape, dtype, lambda: torch.cat([_as_torch(v, dtype) for v in parts], axis))


def maximum(values: Sequence[np.ndarray | LazyWeight]) -> np.ndarray | LazyWeight:
    """Element-wise maximum of equally shaped values (a recipe if any of them is one)."""
    first = _first_recipe(values)
    if first is None:
        return np.asarray(np.max(values, axis=0), dtype=values[0].dtype)
    parts, dtype = list(values), first.torch_dtype
    return LazyWeight(
        first.shape,
        dtype,
        lambda: torch.stack([_as_torch(v, dtype) for v in parts]).amax(0),
    )


def bind(graph: gs.Graph, weights: Mapping[str, LazyWeight]) -> None:
    """Give each placeholder constant of ``graph`` (from `export.export_onnx`) its recipe."""
    unbound = []
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant) and isinstance(tensor._values, LazyValues):
            if not is_placeholder(tensor._values.tensor):
                continue
            recipe = weights.get(tensor.name)
            if recipe is None:
                unbound.append(tensor.name)
                continue
            if recipe.shape != tuple(tensor._values.shape):
                raise RuntimeError(
                    f"weight {tensor.name}: the graph has shape {tuple(tensor._values.shape)}, "
                    f"the checkpoint gives {recipe.shape}"
                )
            tensor.values = recipe
    if unbound:
        raise RuntimeError(f"{len(unbound)} weight(s) have no source, e.g. {unbound[:3]}")


def recipes(graph: gs.Graph) -> dict[str, LazyWeight]:
    """The recipes of ``graph``'s constants by id (each placeholder initializer names one)."""
    return {
        t._values.id: t._values
        for t in graph.tensors().values()
        if isinstance(t, gs.Constant) and isinstance(t._values, LazyWeight)
    }


def plan_weights(
    skeleton: torch.nn.Module,
    source: WeightSource,
    dtype: torch.dtype,
    quantized=None,
    shard: Callable[[str], tuple[int, int, int, int] | None] | None = None,
) -> dict[str, LazyWeight]:
    """The recipe of every parameter and buffer of ``skeleton`` (the step model on fake
    tensors) that comes from the checkpoint: names as transformers', so a tensor is the
    source's of the same name, cast to ``dtype`` (as ``model.to(dtype)`` would), or, under a
    quantized Linear, its plugin module's tensor (`QuantizationResult.linears`; scales and
    biases follow the model dtype as the module's ``to`` decides). ``quantized.overrides``
    replace source tensors the quantization changed (AWQ's folded norms).

    ``shard(name) -> (dim, start, stop, whole) | None`` makes it one tensor-parallel rank's plan
    (`compiler.parallel.tensor_slice`): each recipe produces the rank's part of its tensor,
    reading only that part from a checkpoint."""

    overrides = getattr(quantized, "overrides", None) or {}
    linears = quantized.linears if quantized is not None else {}

    def module_tensor(prefix: str, leaf: str) -> torch.Tensor:
        # The plugin module decides which of its tensors follow the model dtype. `linears`
        # keeps its last few entries: the parts of a merged q/k/v are asked for in turn.
        return getattr(linears[prefix].module().to(dtype), leaf).detach()

    plan: dict[str, LazyWeight] = {}
    real = {n for n, b in skeleton.named_buffers() if not _is_fake(b)}
    for name, t in itertools.chain(skeleton.named_parameters(), skeleton.named_buffers()):
        if name in real:
            continue  # computed at export (rotary tables): real tensors in the graph
        prefix, _, leaf = name.rpartition(".")
        where = shard(name) if shard is not None else None
        if prefix in linears:
            plan[name] = LazyWeight(
                t.shape,
                t.dtype,
                lambda p=prefix, leaf=leaf, w=where: _part(module_tensor(p, leaf), w),
            )
        elif name in overrides:
            plan[name] = LazyWeight(
                t.shape, t.dtype, lambda n=name, w=where: _part(overrides[n].detach().to(dtype), w)
            )
        else:
            info = source.info().get(name)
            if info is None:
                raise BuildError(
                    f"the checkpoint has no tensor {name}, which the "
                    f"{skeleton.geometry.architecture} "
                    "layout needs (is it a checkpoint of this architecture?)"
                )
            expected = list(t.shape)
            if where is not None:  # the checkpoint holds the whole tensor, the rank a part
                dim, _, _, whole = where
                expected[dim] = whole
            if list(info.shape) != expected:
                raise BuildError(
                    f"checkpoint tensor {name} has shape {list(info.shape)}, the config "
                    f"implies {expected} (config.json and weights disagree)"
                )
            plan[name] = LazyWeight(
                t.shape,
                t.dtype,
                lambda n=name, w=where: (
                    source.read(n) if w is None else source.read_slice(n, *w[:3])
                ).to(dtype),
            )
    return plan


def _part(tensor: torch.Tensor, where: tuple[int, int, int, int] | None) -> torch.Tensor:
    """A rank's ``[start, stop)`` of dimension ``dim`` of ``tensor`` (all of it for None)."""
    if where is None:
        return tensor
    dim, start, stop, _ = where
    return tensor.narrow(dim, start, stop - start)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
