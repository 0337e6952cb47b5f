"""The quantized tensors of a Linear, and where a build keeps them until they are written.

`Int4Weights` / `Fp8Weights` are the inputs of one `trtc::Int4Gemm` / `trtc::Fp8Gemm` node.
`QuantizedLinears` maps every quantized Linear's name to them without holding them all: each is
produced or read back when asked for (RTN straight from the source, calibrated methods from a
`LayerStore`: one safetensors file per decoder layer in a spill directory, or memory), and only
the few asked for last are kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from trtc.compiler.checkpoint import WeightSource
from trtc.compiler.quantize import rtn
from trtc.compiler.quantize.layers import LAYERS_PREFIX
from trtc.plugins.fp8_gemm import Fp8Linear
from trtc.plugins.int4_gemm import Int4Linear, pack_int4
from trtc.plugins.int4_gemm import dequantize as int4_dequantize
from trtc.plugins.int4_gemm.reference import num_groups

# Linears `QuantizedLinears` keeps after handing them out: the consumer reads them roughly in
# layer order, a few at a time.
CACHED_LINEARS = 4


@dataclass
class Int4Weights:
    """Inputs of one `trtc::Int4Gemm` node (scales fp32 here: cast to the model dtype)."""

    qweight: torch.Tensor  # uint8 [N, K/2], low nibble = even k
    scales: torch.Tensor  # fp32 [N, ceil(K/g)]
    zeros: torch.Tensor  # uint8 [N, ceil(K/g)], 0..15
    bias: torch.Tensor | None  # [N] or None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    def dequantize(self) -> torch.Tensor:
        return int4_dequantize(self.qweight, self.scales, self.zeros, self.group_size)

    def nbytes(self, scale_bytes: int = 2) -> int:
        return self.size(*self.shape, self.group_size, scale_bytes)

    @staticmethod
    def size(n: int, k: int, group_size: int, scale_bytes: int = 2) -> int:
        """Bytes of the packed weights, scales and zeros of an ``[n, k]`` Linear."""
        g = num_groups(k, group_size)
        return n * (k // 2) + n * g * scale_bytes + n * g

    def module(self) -> Int4Linear:
        return Int4Linear(self.qweight, self.scales, self.zeros, self.bias, self.group_size)


@dataclass
class Fp8Weights:
    """Inputs of one `trtc::Fp8Gemm` node."""

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor  # fp32 [N]
    input_scale: torch.Tensor  # fp32 []
    bias: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    def nbytes(self) -> int:
        return self.size(*self.shape)

    @staticmethod
    def size(n: int, k: int) -> int:
        """Bytes of the E4M3 weights, their scales and the input scale of an ``[n, k]`` Linear."""
        return n * k + n * 4 + 4

    def module(self) -> Fp8Linear:
        return Fp8Linear(self.weight, self.weight_scale, self.input_scale, self.bias)


Weights = Int4Weights | Fp8Weights


class QuantizedLinears(Mapping):
    """``name -> Int4Weights | Fp8Weights`` for the Linears of ``shapes`` (name ->
    ``(out_features, in_features)``, in layer order), each from ``load(name)`` when asked for;
    the last `CACHED_LINEARS` handed out are kept."""

    def __init__(self, shapes: Mapping[str, tuple[int, int]], load: Callable[[str], Weights]):
        self.shapes = dict(shapes)
        self._load = load
        self._cache: OrderedDict[str, Weights] = OrderedDict()

    def __getitem__(self, name: str) -> Weights:
        if name not in self.shapes:
            raise KeyError(name)
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        weights = self._load(name)
        self._cache[name] = weights
        while len(self._cache) > CACHED_LINEARS:
            self._cache.popitem(last=False)
        return weights

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def rtn_loader(
    source: WeightSource, group_size: int, partial_groups: bool
) -> Callable[[str], Int4Weights]:
    """`QuantizedLinears`' ``load`` for RTN: the Linear's weight read from ``source`` (fp32) and
    quantized on the spot; no calibration, nothing kept."""

    def load(name: str) -> Int4Weights:
        weight = source.read(f"{name}.weight").float()
        q, scales, zeros = rtn.quantize_rtn(weight, group_size, name, partial_groups=partial_groups)
        bias = source.read(f"{name}.bias").float() if f"{name}.bias" in source else None
        return Int4Weights(pack_int4(q), scales, zeros, bias, group_size)

    return load


def layer_of(name: str) -> int:
    """The decoder layer index in a Linear's name (``model.layers.3.mlp.down_proj`` -> 3)."""
    return int(name[len(LAYERS_PREFIX) + 1 :].partition(".")[0])


class LayerStore:
    """The quantized Linears of each decoder layer, put once a layer is done: written to
    ``spill_dir/layer{i}.safetensors`` (when given) or kept in memory; `load` gives one back."""

    def __init__(self, spill_dir: Path | None):
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
        self._memory: dict[str, Weights] = {}

    def path(self, index: int) -> Path:
        return self.spill_dir / f"layer{index}.safetensors"

    def put(self, index: int, linears: Mapping[str, Weights]) -> None:
        """Keep layer ``index``'s quantized Linears (``{name: weights}``, on the CPU)."""
        if self.spill_dir is None:
            self._memory.update(linears)
            return
        from safetensors.torch import save_file

        tensors = {
            f"{name}.{field}": value.contiguous()
            for name, weights in linears.items()
            for field, value in vars(weights).items()
            if isinstance(value, torch.Tensor)
        }
        group_sizes = {w.group_size for w in linears.values() if isinstance(w, Int4Weights)}
        metadata = {"group_size": str(group_sizes.pop())} if group_sizes else {}
        save_file(tensors, self.path(index), metadata=metadata)

    def load(self, name: str) -> Weights:
        if self.spill_dir is None:
            return self._memory[name]
        from safetensors import safe_open

        with safe_open(self.path(layer_of(name)), framework="pt") as f:
            group_size = (f.metadata() or {}).get("group_size")
            keys = set(f.keys())

            def get(field: str) -> torch.Tensor | None:
                key = f"{name}.{field}"
                return f.get_tensor(key) if key in keys else None

            if f"{name}.qweight" in keys:
                return Int4Weights(
                    get("qweight"), get("scales"), get("zeros"), get("bias"), int(group_size)
                )
            if f"{name}.weight" in keys:
                return Fp8Weights(
                    get("weight"), get("weight_scale"), get("input_scale"), get("bias")
                )
        raise KeyError(f"{name} is not in {self.path(layer_of(name))}")
