"""Hugging Face checkpoint directories with random weights at real geometries (`trtc checkpoint`),
written a tensor at a time, so that an 8B checkpoint never has to fit in memory.

The directory holds what transformers' ``save_pretrained`` writes for the same config:
``config.json``, ``generation_config.json``, the tokenizer (the byte-level one of `tiny.py`) and
the weights as safetensors: one ``model.safetensors``, or ``model-0000i-of-0000N.safetensors``
shards split as transformers splits them plus ``model.safetensors.index.json``. Each file is byte
for byte what the safetensors library writes for the same tensors: its header is computed from
the shapes alone, then every tensor is generated in fixed-size pieces, cast and appended.

A tensor's values depend only on (seed, tensor name, dtype): the same call writes the same bytes
with the same torch build on the same kind of CPU (torch's normal sampler has vectorized and
scalar paths that may differ in the last bit), whatever the shard size or writing order.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trtc.compiler.checkpoint import SAFETENSORS_DTYPES, SAFETENSORS_INDEX, SAFETENSORS_SINGLE
from trtc.compiler.memory import gb
from trtc.compiler.tiny import TINY_MODELS, byte_tokenizer, tiny_config
from trtc.errors import ConfigError

if TYPE_CHECKING:
    import torch

# torch and transformers are imported inside the functions: the CLI lists the geometry names
# without loading them.

# Geometries beyond tiny.py's models, in the same form: name -> (config class, its arguments).
# The byte tokenizer's BOS/EOS ids (256, 257) replace the real ones, so that the tokenizer and
# the config agree; a checkpoint's vocabulary may be larger than the tokenizer's.
GEOMETRIES = {
    # Meta-Llama-3-8B: GQA 32:8, untied head, no rope scaling; 16 GB in bf16.
    "llama-3-8b": (
        "LlamaConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=256,
            eos_token_id=257,
        ),
    ),
}

# dtype name -> (torch dtype attribute, bytes per element)
DTYPES = {"bf16": ("bfloat16", 2), "fp16": ("float16", 2), "fp32": ("float32", 4)}
# torch dtype attribute -> safetensors dtype name (checkpoint.py reads them back by this table)
_SAFETENSORS_NAME = {torch_name: st for st, torch_name in SAFETENSORS_DTYPES.items()}

# huggingface_hub's default shard size: Llama-3-8B in bf16 is four shards, as published.
DEFAULT_SHARD_BYTES = 5 * 10**9
# Matrices and biases: normal with this standard deviation, small so that fp16 activations stay
# finite at these widths (tiny.INIT_STD's reasoning). Norm scales are ones.
WEIGHT_STD = 0.02
# Values are drawn in fp32 pieces of this many elements (64 MB), then cast: the piece size is
# part of what the values are, so it is a constant, not a tuning knob.
PIECE_ELEMENTS = 1 << 24

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def checkpoint_names() -> list[str]:
    """Every geometry a checkpoint can be written for: tiny.py's models, then `GEOMETRIES`."""
    return [*TINY_MODELS, *GEOMETRIES]


def checkpoint_config(name: str):
    """The transformers config of geometry ``name`` (architectures set)."""
    if name in TINY_MODELS:
        return tiny_config(name)
    if name not in GEOMETRIES:
        raise ConfigError(
            f"checkpoint: unknown geometry {name!r} (known: {', '.join(checkpoint_names())})"
        )
    import transformers

    class_name, kwargs = GEOMETRIES[name]
    config = getattr(transformers, class_name)(**kwargs)
    config.architectures = [class_name.replace("Config", "ForCausalLM")]
    return config


def parse_size(text: str) -> int:
    """Bytes from '5GB', '500MB', '2GiB' or a plain number (decimal units as Hugging Face's)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r}: expected a size such as 5GB, 500MB, 2GiB or a byte count")
    value = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()])
    if value < 1:
        raise ValueError(f"{text!r}: a shard size must be at least one byte")
    return value


def format_size(n: int) -> str:
    """'16.06 GB', '2.2 MB': decimal units, as `parse_size` reads them."""
    return gb(n)


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ConfigError(f"checkpoint: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, DTYPES[dtype][0])


# --- what transformers saves, and how it splits it ---


def saved_tensors(config) -> tuple[dict[str, tuple[int, ...]], int]:
    """The tensors transformers' ``save_pretrained`` writes for ``config``: name -> shape in
    state-dict order, and the model's parameter count (the index's ``total_parameters``).

    Read from the model built on the meta device (no memory): non-persistent buffers are not in
    the state dict, and of tied weights only the name transformers keeps remains."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from trtc.compiler.families import hf_skeleton

    model = hf_skeleton(config)
    state = model.state_dict()
    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    return {name: tuple(t.shape) for name, t in state.items()}, model.num_parameters()


def plan_shards(sizes: dict[str, int], max_bytes: int) -> dict[str, list[str]]:
    """File name -> tensor names, split as huggingface_hub splits a state dict (in order; a
    tensor larger than ``max_bytes`` gets a shard of its own, placed when it is met)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, nbytes in sizes.items():
        if nbytes > max_bytes:
            shards.append([name])
            continue
        if current_bytes + nbytes > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += nbytes
    if current:
        shards.append(current)
    if len(shards) == 1:
        return {SAFETENSORS_SINGLE: shards[0]}
    n = len(shards)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": names for i, names in enumerate(shards)}


def safetensors_header(
    shapes: dict[str, tuple[int, ...]], st_dtype: str, itemsize: int
) -> tuple[bytes, list[str]]:
    """A safetensors file's first bytes (8-byte length, JSON header padded with spaces to a
    multiple of 8) for tensors of one dtype, and the tensor names in data order.

    Laid out as the safetensors library lays it out, so the file is byte for byte the one
    ``safetensors.torch.save_file(..., metadata={"format": "pt"})`` writes: metadata first,
    tensors sorted by name (the library sorts by alignment, the dtype's size, then name; here
    there is one dtype)."""
    order = sorted(shapes)
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        nbytes = itemsize * math.prod(shapes[name])
        header[name] = {
            "dtype": st_dtype,
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


# --- values ---


def _init(name: str, ndim: int) -> float | None:
    """Standard deviation of a tensor's normal values, or None for ones (norm scales)."""
    if ndim == 1 and not name.endswith(".bias"):
        return None
    return WEIGHT_STD


def _generator_seed(seed: int, name: str) -> int:
    # A stable hash (Python's hash() of a str changes per process).
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _pieces(name: str, shape: tuple[int, ...], dtype: str, seed: int) -> Iterator[torch.Tensor]:
    """The tensor's values in flat order, in pieces of at most `PIECE_ELEMENTS`, each a tensor
    of its own (a piece may still be being written while the next is drawn)."""
    import torch

    target = _torch_dtype(dtype)
    numel = math.prod(shape)
    std = _init(name, len(shape))
    if std is None:
        for start in range(0, numel, PIECE_ELEMENTS):
            yield torch.ones(min(PIECE_ELEMENTS, numel - start), dtype=target)
        return
    gen = torch.Generator().manual_seed(_generator_seed(seed, name))
    # Drawn in fp32 whatever the target, so the values of one seed agree across dtypes.
    buf = torch.empty(min(PIECE_ELEMENTS, numel), dtype=torch.float32)
    for start in range(0, numel, PIECE_ELEMENTS):
        n = min(PIECE_ELEMENTS, numel - start)
        piece = torch.empty(n) if target == torch.float32 else buf[:n]
        piece.normal_(0.0, std, generator=gen)
        yield piece if target == torch.float32 else piece.to(target)


def random_tensor(name: str, shape: tuple[int, ...], dtype: str = "bf16", seed: int = 0):
    """The values `write_random_checkpoint` writes for tensor ``name`` (all in memory)."""
    import torch

    out = torch.empty(math.prod(shape), dtype=_torch_dtype(dtype))
    start = 0
    for piece in _pieces(name, tuple(shape), dtype, seed):
        out[start : start + piece.numel()] = piece
        start += piece.numel()
    return out.reshape(shape)


# --- the directory ---


@dataclass(frozen=True)
class ShardWritten:
    """One weights file done (the progress callback's argument)."""

    index: int  # 1-based
    count: int
    filename: str
    tensors: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class CheckpointWritten:
    path: Path
    files: list[str]  # relative to path, sorted
    bytes: int  # all files
    weight_bytes: int  # tensor data (the index's total_size)
    parameters: int
    seconds: float


def _check_free_space(staging: Path, needed: int) -> None:
    free = shutil.disk_usage(staging).free
    # Config and tokenizer files are a few MB at most.
    if free < needed + 16 * 2**20:
        raise ConfigError(
            f"output: the checkpoint needs {format_size(needed)} and {staging.parent} has "
            f"{format_size(free)} free; free some space or choose another --output"
        )


def _write_shard(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str, seed: int) -> int:
    import torch

    torch_name, itemsize = DTYPES[dtype]
    st_dtype = _SAFETENSORS_NAME[torch_name]
    header, order = safetensors_header(shapes, st_dtype, itemsize)
    # One piece is written (a thread, the GIL released) while the next is drawn: drawing and
    # writing take about as long each.
    with open(path, "wb") as f, ThreadPoolExecutor(1) as pool:
        f.write(header)
        pending = None
        for name in order:
            for piece in _pieces(name, shapes[name], dtype, seed):
                # safetensors data is little-endian, as torch's CPU tensors are on x86 and ARM.
                data = piece.view(torch.uint8).numpy()
                if pending is not None:
                    pending.result()  # a write's error surfaces here
                pending = pool.submit(f.write, data)
        if pending is not None:
            pending.result()
        return f.tell()


def write_random_checkpoint(
    name: str,
    output_dir: str | Path,
    dtype: str = "bf16",
    seed: int = 0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Callable[[ShardWritten], None] | None = None,
    force: bool = False,
) -> CheckpointWritten:
    """Write a Hugging Face checkpoint of geometry ``name`` (see `checkpoint_names`) with
    random weights to ``output_dir``: config, generation config, tokenizer and safetensors
    weights in files of at most ``shard_bytes`` (a larger tensor gets a file of its own).

    The directory appears only when complete; an existing one is replaced only with ``force``.
    ``progress`` is called after each weights file."""
    from transformers import GenerationConfig

    start = time.perf_counter()
    output = Path(output_dir).absolute()
    torch_dtype = _torch_dtype(dtype)
    if shard_bytes < 1:
        raise ConfigError(f"checkpoint: shard size {shard_bytes} must be at least one byte")
    config = checkpoint_config(name)
    config.dtype = torch_dtype
    shapes, parameters = saved_tensors(config)
    sizes = {tensor: DTYPES[dtype][1] * math.prod(shape) for tensor, shape in shapes.items()}
    shards = plan_shards(sizes, shard_bytes)
    weight_bytes = sum(sizes.values())

    from trtc.compiler.writer import staging_dir

    with staging_dir(output, force, marker="config.json", what="checkpoint directory") as staging:
        _check_free_space(staging, weight_bytes)
        config.save_pretrained(staging)
        GenerationConfig.from_model_config(config).save_pretrained(staging)
        byte_tokenizer().save_pretrained(staging)
        for i, (filename, names) in enumerate(shards.items()):
            t0 = time.perf_counter()
            nbytes = _write_shard(staging / filename, {n: shapes[n] for n in names}, dtype, seed)
            if progress:
                progress(
                    ShardWritten(
                        i + 1, len(shards), filename, len(names), nbytes, time.perf_counter() - t0
                    )
                )
        if len(shards) > 1:
            index = {
                "metadata": {"total_parameters": parameters, "total_size": weight_bytes},
                "weight_map": {t: filename for filename, names in shards.items() for t in names},
            }
            # json.dumps as transformers' save_pretrained calls it, so the index is identical.
            (staging / SAFETENSORS_INDEX).write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
        files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
        total = sum((staging / f).stat().st_size for f in files)

    return CheckpointWritten(
        path=output,
        files=files,
        bytes=total,
        weight_bytes=weight_bytes,
        parameters=parameters,
        seconds=time.perf_counter() - start,
    )
