"""Layer-by-layer calibration plumbing shared by AWQ, GPTQ and FP8.

The calibration set runs through the model one decoder layer at a time (the GPTQ/AWQ scheme):
only one layer's inputs and outputs are held at once, and a layer can be changed (scaled,
quantized) before the next one sees its output. Decoder layers are called as transformers
calls them, with the keyword arguments (masks, rotary tables) captured from a real forward, so
sliding-window and per-layer-type masks come out right for every architecture.
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


def decoder_layers(hf_model) -> nn.ModuleList:
    try:
        layers = hf_model.model.layers
    except AttributeError:
        raise ValueError(
            f"{type(hf_model).__name__} has no model.layers: trtc quantizes "
            f"Llama-style decoders (Llama, Mistral, Qwen2)"
        ) from None
    for path in LINEARS:
        if not isinstance(layers[0].get_submodule(path), nn.Linear):
            raise ValueError(f"model.layers.0.{path} is not an nn.Linear")
    return layers


def linear(layer: nn.Module, path: str) -> nn.Linear:
    return layer.get_submodule(path)


class _Stop(Exception):
    """Raised by a hook to end a forward early once it has what it needs."""


@dataclass
class LayerInputs:
    """What enters one decoder layer for every calibration batch."""

    hidden: list[torch.Tensor]  # per batch [B, L, hidden], fp32
    kwargs: list[dict]  # per batch: the keyword arguments of the layer call

    @property
    def num_tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)


class ModelInputs:
    """Layer-0 inputs of the calibration batches plus each layer's keyword arguments.

    Keyword arguments depend only on the batch shape (no padding, positions from 0), so they
    are captured with one full forward per distinct batch shape."""

    def __init__(self, hf_model, token_batches: list[list[int]], batch_size: int):
        self.layers = decoder_layers(hf_model)
        ids = torch.tensor(token_batches, dtype=torch.long)
        chunks = list(ids.split(batch_size))
        self.layer_kwargs: dict[tuple, list[dict]] = {}
        for chunk in chunks:
            if tuple(chunk.shape) not in self.layer_kwargs:
                self.layer_kwargs[tuple(chunk.shape)] = self._capture_kwargs(hf_model, chunk)
        self.first = LayerInputs(
            [self._capture_hidden(hf_model, c) for c in chunks], [None] * len(chunks)
        )
        self.shapes = [tuple(c.shape) for c in chunks]

    def for_layer(self, index: int, hidden: list[torch.Tensor]) -> LayerInputs:
        return LayerInputs(hidden, [self.layer_kwargs[s][index] for s in self.shapes])

    def _capture_kwargs(self, hf_model, ids: torch.Tensor) -> list[dict]:
        captured: list[dict] = []

        def hook(module, args, kwargs):
            captured.append(dict(kwargs))
            if len(captured) == len(self.layers):
                raise _Stop

        with _hooks(
            [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in self.layers]
        ):
            try:
                hf_model(input_ids=ids, use_cache=False)
            except _Stop:
                pass
        return captured

    def _capture_hidden(self, hf_model, ids: torch.Tensor) -> torch.Tensor:
        captured = []

        def hook(module, args, kwargs):
            captured.append((args[0] if args else kwargs["hidden_states"]).detach().float())
            raise _Stop

        with _hooks([self.layers[0].register_forward_pre_hook(hook, with_kwargs=True)]):
            try:
                hf_model(input_ids=ids, use_cache=False)
            except _Stop:
                pass
        return captured[0]


@contextmanager
def _hooks(handles) -> Iterator[None]:
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def run_layer(layer: nn.Module, inputs: LayerInputs) -> list[torch.Tensor]:
    """The layer's outputs for every batch (the next layer's hidden inputs)."""
    outs = []
    for hidden, kwargs in zip(inputs.hidden, inputs.kwargs):
        out = layer(hidden.to(_dtype(layer)), **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        outs.append(out.detach().float())
    return outs


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

    def make_hook(path):
        def hook(module, args):
            on_input(path, args[0].detach().reshape(-1, args[0].shape[-1]).float())
            remaining.discard(path)
            if not remaining:
                raise _Stop

        return hook

    with _hooks([linear(layer, p).register_forward_pre_hook(make_hook(p)) for p in paths]):
        for hidden, kwargs in zip(inputs.hidden, inputs.kwargs):
            remaining.update(paths)
            try:
                layer(hidden.to(_dtype(layer)), **kwargs)
            except _Stop:
                pass


def _dtype(layer: nn.Module) -> torch.dtype:
    return next(layer.parameters()).dtype
