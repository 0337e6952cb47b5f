"""Per-layer calibration plumbing shared by AWQ, GPTQ, FP8 and the KV-cache scales.

The calibration set runs through the model one decoder layer at a time (the GPTQ/AWQ scheme):
only one layer's inputs are held at once, and a layer can be changed (scaled, quantized) before
the next one sees its output. Decoder layers are called as transformers calls them, with the
keyword arguments (masks, rotary tables) captured from the model's own forward (see `stack`),
so sliding-window and per-layer-type masks come out right for every architecture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

# The Linear layers of a decoder layer that trtc quantizes, in execution order (transformers'
# attribute paths; the step model uses the same names).
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)

# Linears that read the same input, in execution order: one calibration capture serves a group.
INPUT_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)

# Where the decoder layers live in transformers' causal LMs: state-dict names start with it.
LAYERS_PREFIX = "model.layers"


def decoder_layers(hf_model) -> nn.ModuleList:
    """``hf_model.model.layers``, checked to hold the Linears trtc quantizes."""
    try:
        layers = hf_model.model.layers
    except AttributeError:
        raise ValueError(
            f"{type(hf_model).__name__} has no model.layers: trtc quantizes "
            f"Llama-style decoders (Llama, Mistral, Qwen2)"
        ) from None
    for path in LINEARS:
        if not isinstance(layers[0].get_submodule(path), nn.Linear):
            raise ValueError(f"{LAYERS_PREFIX}.0.{path} is not an nn.Linear")
    return layers


def linear(layer: nn.Module, path: str) -> nn.Linear:
    return layer.get_submodule(path)


class Stop(Exception):
    """Raised by a hook to end a forward early once it has what it needs."""


@dataclass
class LayerInputs:
    """What enters one decoder layer for every calibration batch. ``hidden`` is the stream's
    own list: `run_layer` replaces its entries by the layer's outputs."""

    hidden: list[torch.Tensor]  # per batch [B, L, hidden], fp32
    kwargs: list[dict]  # per batch: the keyword arguments of the layer call

    @property
    def num_tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)


@contextmanager
def hooks(handles) -> Iterator[None]:
    """Remove the hook ``handles`` on exit."""
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def input_hooks(
    layer: nn.Module, paths: tuple[str, ...], on_input: Callable[[str, torch.Tensor], None]
) -> list:
    """Pre-hooks calling ``on_input(path, x [tokens, in_features] fp32)`` with each input of the
    Linears ``paths``; returns their handles (for `hooks`)."""

    def make_hook(path):
        def hook(module, args):
            on_input(path, args[0].detach().reshape(-1, args[0].shape[-1]).float())

        return hook

    return [linear(layer, p).register_forward_pre_hook(make_hook(p)) for p in paths]


def output_hooks(
    layer: nn.Module, paths: tuple[str, ...], on_output: Callable[[str, torch.Tensor], None]
) -> list:
    """Forward hooks calling ``on_output(path, y)`` with each output of the Linears ``paths``;
    returns their handles (for `hooks`)."""

    def make_hook(path):
        def hook(module, args, out):
            on_output(path, out.detach())

        return hook

    return [linear(layer, p).register_forward_hook(make_hook(p)) for p in paths]


def run_layer(layer: nn.Module, inputs: LayerInputs) -> None:
    """Advance the stream through ``layer``: each batch's hidden states are replaced, in place
    in ``inputs.hidden``, by the layer's outputs (the next layer's inputs), so a stream holds
    one batch more than its activations, not twice them."""
    for j, kwargs in enumerate(inputs.kwargs):
        out = layer(inputs.hidden[j], **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        inputs.hidden[j] = out.detach().float()


def capture_inputs(
    layer: nn.Module,
    inputs: LayerInputs,
    paths: tuple[str, ...],
    on_input: Callable[[str, torch.Tensor], None],
) -> None:
    """Run the layer over every batch and call ``on_input(path, x [tokens, in_features] fp32)``
    with the input of each Linear in ``paths`` (per batch). The forward stops right after the
    last of them has been seen, so capturing early Linears costs little."""
    remaining = set()

    def seen(path, x):
        on_input(path, x)
        remaining.discard(path)
        if not remaining:
            raise Stop

    with hooks(input_hooks(layer, paths, seen)):
        for hidden, kwargs in zip(inputs.hidden, inputs.kwargs):
            remaining.update(paths)
            try:
                layer(hidden, **kwargs)
            except Stop:
                pass
