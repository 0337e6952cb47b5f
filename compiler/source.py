"""Stage 1, load: a checkpoint (HF directory, GGUF file or tiny random model) becomes a
`WeightSource` (its tensors, read one at a time), its transformers config and tokenizer, its
geometry and a hash that identifies it.

A Hugging Face directory of safetensors files is never loaded whole: its tensors are read when
the artifact is written. GGUF files (which transformers dequantizes as it loads them), a
directory without safetensors, tiny random models and models with a LoRA adapter merged are
loaded by transformers into memory (fp32: four bytes a parameter) and read from there."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from trtc.compiler.checkpoint import (
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    SafetensorsCheckpoint,
    StateDictSource,
    WeightSource,
)
from trtc.compiler.config import BuildConfig
from trtc.compiler.families import ModelGeometry, check_supported, geometry_from_config
from trtc.compiler.tiny import byte_tokenizer, tiny_config, tiny_model
from trtc.errors import BuildError, ConfigError


@dataclass
class LoadedSource:
    weights: WeightSource
    config: object  # the transformers config
    tokenizer: object
    geometry: ModelGeometry
    source: dict  # manifest record: kind, path, sha256
    streamed: bool  # weights read from disk a tensor at a time (not held in memory)


def _sha256_files(paths: list[Path], root: Path | None = None) -> str:
    h = hashlib.sha256()
    for p in paths:
        if root is not None:
            h.update(str(p.relative_to(root)).encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def _hf_location(kind: str, path: Path) -> tuple[str, dict]:
    """What transformers' ``from_pretrained`` takes for a checkpoint: a GGUF file is named by
    its directory and ``gguf_file``."""
    if kind == "gguf":
        return str(path.parent), {"gguf_file": path.name}
    return str(path), {}


def _hf_kwargs(cfg: BuildConfig) -> tuple[str, dict]:
    return _hf_location(cfg.model.source, cfg.model.checkpoint)


def load_hf_config(cfg: BuildConfig):
    """The model's transformers config, checked for a supported architecture before any weights
    load."""
    from transformers import AutoConfig

    if cfg.model.source == "tiny":
        config = tiny_config(cfg.model.name)
    else:
        where, kwargs = _hf_kwargs(cfg)
        try:
            config = AutoConfig.from_pretrained(where, **kwargs)
        except (ValueError, KeyError, OSError) as e:
            raise BuildError(f"cannot read the model config from {cfg.model.path}: {e}") from None
    check_supported(config)
    return config


def max_seq_len(cfg: BuildConfig, g: ModelGeometry) -> int:
    """The context length the artifact supports: the config's, or the model's own."""
    if cfg.limits.max_seq_len is None:
        return g.max_position_embeddings
    if cfg.limits.max_seq_len > g.max_position_embeddings:
        raise ConfigError(
            f"limits.max_seq_len: {cfg.limits.max_seq_len} exceeds the model's "
            f"max_position_embeddings {g.max_position_embeddings}"
        )
    return cfg.limits.max_seq_len


def _quiet_gguf_progress() -> None:
    """transformers' GGUF loader draws its own tqdm bar; the build already shows the stage."""
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    if not isinstance(gguf_utils.tqdm, partial):
        gguf_utils.tqdm = partial(gguf_utils.tqdm, disable=True)


@contextlib.contextmanager
def gguf_parsed_once(active: bool = True) -> Iterator[None]:
    """Within this block each GGUF file is parsed once and gguf's tensor-name map built once
    (``active``: the checkpoint is a GGUF file; otherwise the block does nothing).

    transformers parses a GGUF file's metadata anew for the config, for the weights and for the
    tokenizer (gguf's reader walks every field, the tokenizer's vocabulary one entry at a time:
    about 5 s for SmolLM2's 49k tokens on two cores), and builds gguf's tensor-name map again
    for every module of the model (397 times for SmolLM2: 8 s). Both are pure functions of their
    arguments (the reader opens the file read-only; the map is only read), so they are memoized
    here for the block's length: SmolLM2's check and load stages take 15 s instead of 34
    (BENCHMARKS.md, "Build time and memory"). transformers imports both names from gguf when it
    calls them, which is what lets the block swap them (for the process: a build loads in one
    thread); they are put back on the way out."""
    if not active:
        yield
        return
    import gguf

    read, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, object] = {}

    def reader(path, mode: str = "r"):
        if mode != "r":
            return read(path, mode)
        st = os.stat(path)  # a file replaced or rewritten meanwhile is parsed again
        key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in readers:
            readers[key] = read(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = read, name_map


def _streamable(cfg: BuildConfig) -> bool:
    """An HF directory of safetensors, no adapter to merge: weights stream from disk."""
    if cfg.model.source != "hf" or cfg.model.lora is not None:
        return False
    checkpoint = cfg.model.checkpoint
    return (checkpoint / SAFETENSORS_INDEX).is_file() or (checkpoint / SAFETENSORS_SINGLE).is_file()


def load_source(cfg: BuildConfig, config) -> LoadedSource:
    """The checkpoint ``cfg`` names, whose transformers ``config`` `load_hf_config` read (the
    build runs both inside one `gguf_parsed_once`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the build shows its own per-stage progress
    _quiet_gguf_progress()
    geometry = geometry_from_config(config)
    max_seq_len(cfg, geometry)
    lora_record = None
    if cfg.model.lora is not None:  # checked against the config before weights load
        from trtc.compiler.lora import check_adapter

        lora_record = check_adapter(cfg.model.adapter, config, cfg.model.lora)
    model = None
    if cfg.model.source == "tiny":
        model = tiny_model(cfg.model.name, cfg.model.seed)
        tokenizer = byte_tokenizer()
        recipe = json.dumps(
            {"name": cfg.model.name, "seed": cfg.model.seed, "config": config.to_diff_dict()},
            sort_keys=True,
            default=str,
        )
        source = {
            "kind": "tiny",
            "path": cfg.model.name,
            "seed": cfg.model.seed,
            "sha256": hashlib.sha256(recipe.encode()).hexdigest(),
        }
    else:
        where, kwargs = _hf_kwargs(cfg)
        if not _streamable(cfg):
            model = AutoModelForCausalLM.from_pretrained(
                where, dtype=torch.float32, **kwargs
            ).eval()
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        path = cfg.model.checkpoint
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        source = {
            "kind": cfg.model.source,
            "path": str(path.resolve()),
            "sha256": _sha256_files(files, None if path.is_file() else path),
        }
    if getattr(tokenizer, "chat_template", None) is None:
        source["chat_template"] = False
    if lora_record is not None:
        from trtc.compiler.lora import merge_adapter

        model = merge_adapter(model, cfg.model.adapter)
        source["lora"] = lora_record
    if model is None:
        weights: WeightSource = SafetensorsCheckpoint(cfg.model.checkpoint)
    else:
        weights = StateDictSource(
            {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}
        )
    return LoadedSource(weights, config, tokenizer, geometry, source, streamed=model is None)


def load_source_model(source: dict, dtype: torch.dtype = torch.float32):
    """The transformers model an artifact was built from, as its manifest records it (for
    baselines and reference checks)."""
    from transformers import AutoModelForCausalLM

    if source["kind"] == "tiny":
        return tiny_model(source["path"], source.get("seed", 0)).to(dtype)
    where, kwargs = _hf_location(source["kind"], Path(source["path"]))
    with gguf_parsed_once(source["kind"] == "gguf"):
        return AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs).eval()
