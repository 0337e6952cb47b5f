"""Which Hugging Face architectures trtc compiles, and the geometry it reads from their configs."""

from __future__ import annotations

from trtc.artifact import ModelGeometry
from trtc.errors import BuildError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Architectures whose attention normalises q and k per head before the rotary embedding.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM",)


def hf_skeleton(config, dtype=None):
    """transformers' model for ``config`` on the meta device: its modules, parameter names and
    shapes without allocating or initialising a weight. Built from a copy of the config
    (``from_config`` records its attention implementation on the config it is given)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)


def check_supported(config) -> str:
    """The config's architecture, or a BuildError listing what is supported."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        # Configs built in code (tiny models) carry no `architectures`; derive it from model_type.
        by_type = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }
        archs = [
            by_type.get(getattr(config, "model_type", ""), str(getattr(config, "model_type", "?")))
        ]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise BuildError(
            f"unsupported architecture {arch!r} (model_type "
            f"{getattr(config, 'model_type', '?')!r}); trtc supports: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return arch


def _sliding_windows(config, num_layers: int) -> tuple[int, ...]:
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    if getattr(config, "use_sliding_window", True) is False:
        return (0,) * num_layers
    return (int(window),) * num_layers


def geometry_from_config(config) -> ModelGeometry:
    arch = check_supported(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    qkv_bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if not rope:
        rope = {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
        if getattr(config, "rope_scaling", None):
            rope.update(config.rope_scaling)
    return ModelGeometry(
        architecture=arch,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=float(config.rms_norm_eps),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        rope_parameters={k: v for k, v in sorted(rope.items())},
        sliding_windows=_sliding_windows(config, config.num_hidden_layers),
        qk_norm=arch in QK_NORM_ARCHITECTURES,
    )
