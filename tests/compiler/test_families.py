"""The geometry read from each supported family's config, against what transformers builds for
the same config (Qwen3 here: per-head q/k norms, head_dim apart, its sliding-window switch)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from trtc.artifact import ModelGeometry
from trtc.compiler.families import SUPPORTED_ARCHITECTURES, geometry_from_config
from trtc.errors import BuildError

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
)


def qwen3_config(**kwargs) -> Qwen3Config:
    config = Qwen3Config(**{**SMALL, "head_dim": 32, **kwargs})
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def test_qwen3_geometry_matches_transformers_modules():
    config = qwen3_config()
    g = geometry_from_config(config)
    with torch.device("meta"):
        attn = AutoModelForCausalLM.from_config(config).model.layers[0].self_attn
    assert g.architecture == "Qwen3ForCausalLM" and g.qk_norm
    assert g.head_dim == 32 == attn.q_norm.weight.shape[0] == attn.k_norm.weight.shape[0]
    assert attn.q_proj.out_features == g.num_heads * g.head_dim != g.hidden_size
    assert (g.qkv_bias, g.o_bias) == (attn.q_proj.bias is not None, attn.o_proj.bias is not None)
    assert g.qkv_bias is False and g.sliding_windows == (0, 0, 0)
    assert g.rms_norm_eps == attn.q_norm.variance_epsilon


def test_qwen3_attention_bias_and_sliding_window_follow_its_config():
    # transformers slides the layers from max_window_layers on, and only with use_sliding_window.
    config = qwen3_config(
        attention_bias=True, use_sliding_window=True, sliding_window=16, max_window_layers=1
    )
    g = geometry_from_config(config)
    assert g.qkv_bias and g.o_bias
    assert g.sliding_windows == (0, 16, 16)
    assert geometry_from_config(qwen3_config(sliding_window=16)).sliding_windows == (0, 0, 0)


def test_a_manifest_written_before_qk_norm_loads_without_it():
    fields = geometry_from_config(LlamaConfig(**SMALL)).model_dump()
    del fields["qk_norm"]
    assert ModelGeometry.model_validate(fields).qk_norm is False


def test_config_built_in_code_is_named_by_model_type():
    """No ``architectures`` (a config made in code): the family comes from model_type."""
    g = geometry_from_config(Qwen3Config(**SMALL))
    assert g.architecture == "Qwen3ForCausalLM" and g.qk_norm
    for config in (LlamaConfig(**SMALL), Qwen2Config(**SMALL)):
        assert not geometry_from_config(config).qk_norm


def test_unsupported_architecture_is_refused_naming_the_supported_ones():
    config = qwen3_config()
    config.architectures = ["Qwen3MoeForCausalLM"]
    with pytest.raises(BuildError) as e:
        geometry_from_config(config)
    message = str(e.value)
    assert "unsupported architecture 'Qwen3MoeForCausalLM'" in message and "\n" not in message
    assert message.endswith(", ".join(SUPPORTED_ARCHITECTURES))
    assert "Qwen3ForCausalLM" in SUPPORTED_ARCHITECTURES
