"""LoRA: a PEFT adapter merged into the base weights before quantization (the usual pipeline:
fine-tune an adapter, merge it, quantize, deploy). The adapter's shapes are checked against the
model config first, so an adapter for another base model fails before any weight is loaded."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from trtc.errors import ConfigError

KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


def _expected(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection, from the config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (h, heads * head_dim),
        "k_proj": (h, kv * head_dim),
        "v_proj": (h, kv * head_dim),
        "o_proj": (heads * head_dim, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _weights_file(adapter: Path, name: str) -> Path:
    for file in ("adapter_model.safetensors", "adapter_model.bin"):
        if (adapter / file).is_file():
            return adapter / file
    raise ConfigError(f"model.lora: {name} has no adapter_model.safetensors (or .bin)")


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    import torch

    return {
        k: tuple(v.shape)
        for k, v in torch.load(path, map_location="meta", weights_only=True).items()
    }


def check_adapter(adapter: Path, config, name: str) -> dict:
    """Validate the adapter directory ``adapter`` against the base model's config; returns the
    manifest record. Messages call the adapter ``name``, its path as the config wrote it."""
    meta = json.loads((adapter / "adapter_config.json").read_text())
    expected = _expected(config)
    weights = _weights_file(adapter, name)
    base = meta.get("base_model_name_or_path") or "an unnamed base model"
    matched = 0
    for key, shape in _shapes(weights).items():
        m = KEY.search(key)
        if not m:
            continue
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= config.num_hidden_layers or proj not in expected:
            raise ConfigError(
                f"model.lora: {name} adapts {key}, which this model does not have "
                f"({config.num_hidden_layers} layers); it was trained for {base}"
            )
        fan_in, fan_out = expected[proj]
        want = fan_in if ab == "A" else fan_out
        got = shape[1] if ab == "A" else shape[0]
        if got != want:
            raise ConfigError(
                f"model.lora: {name} does not fit this model: layer {layer} {proj} has "
                f"{'in' if ab == 'A' else 'out'}_features {want}, the adapter's lora_{ab} "
                f"expects {got}; it was trained for {base}"
            )
        matched += 1
    if not matched:
        raise ConfigError(
            f"model.lora: {name} holds no LoRA weights for q/k/v/o/gate/up/down projections"
        )
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    return {
        "path": str(adapter.resolve()),
        "sha256": digest,
        "rank": meta.get("r"),
        "alpha": meta.get("lora_alpha"),
        "target_modules": sorted(meta.get("target_modules") or []),
        "base_model": meta.get("base_model_name_or_path"),
        "tensors": matched,
    }


def merge_adapter(hf_model, adapter: Path):
    """The base model with the adapter merged into its weights (peft's merge_and_unload)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model, str(adapter)).merge_and_unload().eval()
