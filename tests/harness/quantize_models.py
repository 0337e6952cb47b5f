"""Models and settings the quantization tests share."""

from __future__ import annotations

import torch

from trtc.compiler.tiny import tiny_model

# Calibration small enough for tests: 4 windows of 64 tokens of the built-in text.
CALIB = dict(calibration_path=None, num_samples=4, seq_len=64)


def outlier_model(name: str, seed: int = 0):
    """A tiny model with a few large-activation channels, as real LLMs have (AWQ's premise:
    AWQ has something to scale)."""
    model = tiny_model(name, seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[torch.arange(0, norm.weight.numel(), 16)] *= 8.0
    return model
