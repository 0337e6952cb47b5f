"""A transformers decoder built one layer at a time from a `WeightSource`.

Calibration never holds the model: `DecoderStack` builds transformers' model on the meta device
(no memory, no initialisation) only to learn its decoder layer modules and how its forward
calls them, then `DecoderStack.layer` builds one real layer in fp32 from that layer's tensors
alone. `DecoderStack.calibration_inputs` gives the layer-0 inputs of the calibration batches
(the embedding rows of their tokens) and the keyword arguments every layer is called with
(rotary tables, attention masks: sliding-window and per-layer-type ones included), recorded
from a forward of the meta model whose decoder layers are replaced by recorders and whose
rotary embedding is rebuilt on the CPU: the masks and tables are transformers' own, computed
exactly as a full forward computes them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from trtc.compiler.checkpoint import WeightSource
from trtc.compiler.families import hf_skeleton
from trtc.compiler.quantize.layers import (
    LAYERS_PREFIX,
    LayerInputs,
    Stop,
    decoder_layers,
)

# Dtypes a layer may be read from; they are upcast to fp32 exactly.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def calibration_device(device: str) -> torch.device:
    """The torch device for ``quantization.calibration.device``, checked to exist."""
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "quantization.calibration.device is 'cuda' but torch sees no CUDA device "
                "(torch.cuda.is_available() is False: a CPU-only torch build, or no visible "
                "GPU); set it to 'cpu', or build on a machine with a GPU"
            )
        return torch.device("cuda")
    raise ValueError(f"calibration device {device!r} is neither 'cpu' nor 'cuda'")


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index`` in the meta model: records what the layer would be
    called with (the hidden states too, for layer 0) and ends the forward after the last."""

    def __init__(self, index: int, last: int, sink: list, attention_type: str | None):
        super().__init__()
        self.index, self.last, self.sink = index, last, sink
        if attention_type is not None:
            # Some models pick each layer's mask by this attribute of the layer.
            self.attention_type = attention_type

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self.sink.append((hidden if self.index == 0 else None, dict(kwargs)))
        if self.index == self.last:
            raise Stop
        return hidden


@dataclass
class CalibrationInputs:
    """Layer-0 inputs of the calibration batches and every layer's keyword arguments.

    Keyword arguments depend only on a batch's shape (no padding, positions from 0), so they
    are kept once per distinct shape."""

    first: list[torch.Tensor]  # per batch: layer 0's hidden states [B, L, hidden], fp32
    shapes: list[tuple[int, int]]  # per batch: (B, L)
    layer_kwargs: dict[tuple[int, int], list[dict]]  # shape -> per layer: keyword arguments

    def for_layer(self, index: int, hidden: list[torch.Tensor]) -> LayerInputs:
        """Layer ``index``'s inputs, ``hidden`` being a stream's hidden states at that layer."""
        return LayerInputs(hidden, [self.layer_kwargs[s][index] for s in self.shapes])


class DecoderStack:
    """The decoder layers of the transformers model of ``config``, with their weights read from
    ``source`` one layer at a time (state-dict names), built on ``device``."""

    def __init__(self, config, source: WeightSource, device: torch.device | str = "cpu"):
        self.source = source
        self.device = torch.device(device)
        skeleton = hf_skeleton(config, dtype=torch.float32)
        self.skeleton = skeleton.eval()
        self.config = skeleton.config
        self.meta_layers = list(decoder_layers(skeleton))
        self.num_layers = len(self.meta_layers)
        self.head_dim = (
            getattr(self.meta_layers[0].self_attn, "head_dim", None)
            or getattr(self.config, "head_dim", None)
            or self.config.hidden_size // self.config.num_attention_heads
        )
        embedding = skeleton.get_input_embeddings()
        self.embedding_name = next(
            f"{name}.weight" for name, m in skeleton.named_modules() if m is embedding
        )
        self._check_source()
        # The real rotary embedding (its buffers are computed from the config at construction).
        inner = skeleton.model
        if hasattr(inner, "rotary_emb"):
            inner.rotary_emb = type(inner.rotary_emb)(config=self.config)
        self._sink: list = []
        last = self.num_layers - 1
        for i, layer in enumerate(self.meta_layers):
            inner.layers[i] = _Recorder(i, last, self._sink, getattr(layer, "attention_type", None))

    def _check_source(self) -> None:
        info = self.source.info()
        needed = [self.embedding_name] + [
            f"{LAYERS_PREFIX}.{i}.{k}"
            for i, layer in enumerate(self.meta_layers)
            for k in layer.state_dict()
        ]
        for name in needed:
            if name not in info:
                raise ValueError(
                    f"the weights have no tensor {name}, which {type(self.skeleton).__name__} "
                    f"needs: the checkpoint does not match its config.json"
                )
            if info[name].dtype not in FLOAT_DTYPES:
                raise ValueError(
                    f"{name} is stored as {info[name].dtype}: trtc quantizes from floating-point "
                    f"weights (fp32, fp16, bf16); give it the unquantized checkpoint"
                )

    def linear_shape(self, index: int, path: str) -> tuple[int, int]:
        """``(out_features, in_features)`` of a Linear, from the source's shapes (nothing read)."""
        n, k = self.source.info()[f"{LAYERS_PREFIX}.{index}.{path}.weight"].shape
        return n, k

    @torch.no_grad()
    def layer(self, index: int) -> nn.Module:
        """Decoder layer ``index`` in fp32 on the stack's device, holding its tensors from the
        source (each read, moved and upcast in turn); in eval mode."""
        layer = copy.deepcopy(self.meta_layers[index])
        state = {
            k: self.source.read(f"{LAYERS_PREFIX}.{index}.{k}").to(self.device).float()
            for k in layer.state_dict()
        }
        layer.load_state_dict(state, assign=True)
        left = [n for n, t in layer.named_buffers() if t.is_meta]
        if left:
            raise ValueError(
                f"{LAYERS_PREFIX}.{index}.{left[0]} is a buffer that is not in the state dict: "
                f"trtc cannot build {type(layer).__name__} layer by layer"
            )
        return layer.eval()

    @torch.no_grad()
    def calibration_inputs(
        self, token_batches: list[list[int]], batch_size: int
    ) -> CalibrationInputs:
        """The calibration windows ``token_batches`` cut into batches of ``batch_size``; their
        layer-0 inputs on the stack's device, and every layer's keyword arguments."""
        chunks = list(torch.tensor(token_batches, dtype=torch.long).split(batch_size))
        table = self.source.read(self.embedding_name)
        rows = [table[c] for c in chunks]  # indexed in the stored dtype, upcast below: exact
        del table
        first: list[torch.Tensor] = []
        layer_kwargs: dict[tuple[int, int], list[dict]] = {}
        for j in range(len(rows)):
            hidden, kwargs = self._record(rows[j].float())
            rows[j] = None
            first.append(hidden.detach().float().to(self.device))
            shape = tuple(chunks[j].shape)
            if shape not in layer_kwargs:
                moved: dict[int, torch.Tensor] = {}  # one device copy of each shared tensor
                layer_kwargs[shape] = [_to_device(k, self.device, moved) for k in kwargs]
        return CalibrationInputs(first, [tuple(c.shape) for c in chunks], layer_kwargs)

    def _record(self, inputs_embeds: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
        self._sink.clear()
        try:
            self.skeleton(inputs_embeds=inputs_embeds, use_cache=False)
        except Stop:
            pass
        if len(self._sink) != self.num_layers:
            raise RuntimeError(
                f"{type(self.skeleton).__name__}'s forward called {len(self._sink)} of its "
                f"{self.num_layers} decoder layers"
            )
        recorded = list(self._sink)
        self._sink.clear()
        return recorded[0][0], [kwargs for _, kwargs in recorded]


def _to_device(obj, device: torch.device, moved: dict[int, torch.Tensor]):
    """``obj`` (tensors in tuples, lists, dicts) with its tensors on ``device``; a tensor met
    twice is moved once (``moved`` is keyed by id: the originals must outlive it)."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        if id(obj) not in moved:
            moved[id(obj)] = obj.to(device)
        return moved[id(obj)]
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device, moved) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, device, moved) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device, moved) for k, v in obj.items()}
    return obj
