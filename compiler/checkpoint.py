"""Where a build reads weights from, a tensor at a time.

A `WeightSource` names its tensors (transformers' state-dict names), tells each one's shape and
dtype without reading it, and reads one tensor on request. `SafetensorsCheckpoint` is a Hugging
Face directory of safetensors files (one file, or shards listed in
``model.safetensors.index.json``); `StateDictSource` wraps tensors already in memory (tiny random
models, GGUF files dequantized by transformers, models with a LoRA adapter merged).

A checkpoint file is opened for each read and closed after it: safetensors memory-maps the
file, and the pages a mapping has touched count as resident while it stays open. Reading a
tensor then costs its own bytes, not its shard's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trtc.errors import BuildError

if TYPE_CHECKING:
    import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

# safetensors' dtype names -> torch dtype names (the ones checkpoints of supported models use).
# Names, not torch objects: the checkpoint writer shares them and must import without torch.
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


class WeightSource:
    """A model's tensors by state-dict name, read one at a time."""

    def info(self) -> Mapping[str, TensorInfo]:
        raise NotImplementedError

    def read(self, name: str) -> torch.Tensor:
        """A tensor of its stored dtype that the caller owns (no view of a shared buffer)."""
        raise NotImplementedError

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``read(name)[..., start:stop, ...]`` along ``dim`` (a tensor-parallel rank's part),
        reading no more of the tensor than a source can avoid."""
        return self.read(name).narrow(dim, start, stop - start).clone()

    def __contains__(self, name: str) -> bool:
        return name in self.info()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.info().values())


class StateDictSource(WeightSource):
    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = dict(tensors)
        self._info = {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in self._tensors.items()}

    def info(self) -> Mapping[str, TensorInfo]:
        return self._info

    def read(self, name: str) -> torch.Tensor:
        return self._tensors[name].detach().clone()


def _read_header(path: Path) -> dict:
    """The JSON header of a safetensors file: ``{name: {dtype, shape, data_offsets}}``."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as e:
        raise BuildError(f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header


class SafetensorsCheckpoint(WeightSource):
    """A Hugging Face checkpoint directory of safetensors files."""

    def __init__(self, directory: Path):
        import torch

        self.directory = Path(directory)
        index = self.directory / SAFETENSORS_INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise BuildError(f"{index}: not a safetensors index ({e})") from None
            shards = sorted(set(weight_map.values()))
        elif (self.directory / SAFETENSORS_SINGLE).is_file():
            weight_map, shards = None, [SAFETENSORS_SINGLE]
        else:
            raise BuildError(
                f"{self.directory}: no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}; trtc "
                "streams weights from safetensors (convert the checkpoint with "
                "transformers' save_pretrained(..., safe_serialization=True))"
            )
        self.files: dict[str, Path] = {}
        self._info: dict[str, TensorInfo] = {}
        for shard in shards:
            path = self.directory / shard
            if not path.is_file():
                raise BuildError(f"{index}: lists shard {shard}, which does not exist")
            for name, entry in _read_header(path).items():
                if entry["dtype"] not in SAFETENSORS_DTYPES:
                    raise BuildError(
                        f"{path}: tensor {name} has dtype {entry['dtype']}, which trtc does not "
                        f"read (supported: {', '.join(SAFETENSORS_DTYPES)})"
                    )
                self.files[name] = path
                self._info[name] = TensorInfo(
                    tuple(entry["shape"]), getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]])
                )
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.files))
            if missing:
                raise BuildError(
                    f"{index}: {len(missing)} tensor(s) listed but not in their shard, e.g. "
                    f"{missing[0]}"
                )

    @property
    def shard_files(self) -> list[Path]:
        return sorted(set(self.files.values()))

    def info(self) -> Mapping[str, TensorInfo]:
        return self._info

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            # get_tensor copies out of the mapping; the mapping closes with the handle.
            return f.get_tensor(name)

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            # Only the slice's bytes are copied out of the mapping.
            index = [slice(None)] * len(self._info[name].shape)
            index[dim] = slice(start, stop)
            return f.get_slice(name)[tuple(index)]
