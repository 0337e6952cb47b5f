"""Entry points: quantize the Linear layers of a transformers decoder, one decoder layer at a
time, and calibrate the FP8 KV-cache scales on the way.

`quantize_source` reads the weights from a `WeightSource` (a checkpoint directory, or tensors in
memory) and never holds the model: one decoder layer in fp32 plus the calibration activations
(`stack.DecoderStack`). It returns the quantized tensors of every q/k/v/o/gate/up/down
projection of every decoder layer (never the embeddings or the LM head), named as in the state
dict (``model.layers.3.mlp.down_proj``), as a mapping that produces or reads back each one when
asked for; the fp tensors the method changed (`QuantizationResult.overrides`); the KV-cache
scales; and `QuantizationResult.record`, the manifest's quantization section.
`quantize_model` does the same for a transformers model in memory (tests, benchmarks).

Calibration streams the calibration set through the layers: layer ``i + 1``'s inputs are
layer ``i``'s outputs. A stream is those hidden states through one version of the model:

* ``fp``: the floating-point layers as read (AWQ's searches, FP8's activation amax, and the
  KV-cache amax except after AWQ);
* ``quantized``: each layer with its Linears already quantized (GPTQ and FP8's error feedback
  calibrate each layer on what the quantized layers before it produce);
* ``folded``: the AWQ-folded layers (the KV-cache amax after AWQ: the model the artifact holds).

Each is kept only when something reads it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trtc.compiler.checkpoint import StateDictSource, WeightSource
from trtc.compiler.quantize import awq, fp8, gptq, kv_cache, rtn
from trtc.compiler.quantize.calibration import CalibrationData, calibration_data
from trtc.compiler.quantize.layers import (
    LAYERS_PREFIX,
    LINEARS,
    LayerInputs,
    decoder_layers,
    hooks,
    input_hooks,
    linear,
    run_layer,
)
from trtc.compiler.quantize.quantized_linears import (
    Fp8Weights,
    Int4Weights,
    LayerStore,
    QuantizedLinears,
    Weights,
    rtn_loader,
)
from trtc.compiler.quantize.stack import CalibrationInputs, DecoderStack, calibration_device
from trtc.plugins.int4_gemm import pack_int4

METHODS = ("rtn", "awq", "gptq", "fp8")
CALIBRATED = ("awq", "gptq", "fp8")  # methods that run the calibration set
NONE = "none"  # quantize_source only: no Linear quantized, the KV-cache scales alone

__all__ = [
    "CALIBRATED",
    "METHODS",
    "NONE",
    "Fp8Weights",
    "Int4Weights",
    "QuantizationResult",
    "quantize_model",
    "quantize_source",
]


@dataclass
class QuantizationResult:
    """What `quantize_source` / `quantize_model` give: the quantized Linears, the fp tensors the
    method changed, the KV-cache scales, and the manifest's records."""

    method: str  # one of METHODS, or NONE
    group_size: int | None  # None for fp8 and none
    act_order: bool
    partial_groups: bool
    calibration: CalibrationData | None  # the text calibrated on (method or KV scales)
    num_decoder_layers: int
    # name -> quantized tensors; produced or read back on access (see weights.QuantizedLinears)
    linears: Mapping[str, Weights] = field(default_factory=dict)
    linear_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)  # [N, K] per name
    # state-dict name -> fp32 tensor: fp tensors the method changed (AWQ: RMSNorm weights)
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_scales: list[tuple[float, float]] | None = None  # (k_scale, v_scale) per layer
    algorithm: dict = field(default_factory=dict)  # the method's settings, for the manifest
    seconds: float = 0.0

    @property
    def bits(self) -> int | None:
        return None if self.method == NONE else 8 if self.method == "fp8" else 4

    def record(self) -> dict:
        """The manifest's quantization section (deterministic: no timings), from the Linears'
        shapes: no quantized tensor is produced or read."""
        if self.method == NONE:
            return {"method": NONE}
        shapes = self.linear_shapes.values()
        before = sum(2 * n * k for n, k in shapes)
        if self.method == "fp8":
            after = sum(Fp8Weights.size(n, k) for n, k in shapes)
        else:
            after = sum(Int4Weights.size(n, k, self.group_size) for n, k in shapes)
        calibrated = self.method in CALIBRATED and self.calibration is not None
        return {
            "method": self.method,
            "bits": self.bits,
            "group_size": self.group_size,
            "partial_groups": self.partial_groups,
            "act_order": self.act_order,
            "weights": "int4 asymmetric, group-wise along K"
            if self.bits == 4
            else "fp8 e4m3, per output channel",
            "activations": "fp8 e4m3, per tensor, static"
            if self.method == "fp8"
            else "unquantized",
            "algorithm": dict(self.algorithm),
            "calibration": self.calibration.record() if calibrated else None,
            "num_decoder_layers": self.num_decoder_layers,
            "num_linears_quantized": len(self.linear_shapes),
            "linear_weight_bytes_fp16": before,
            "linear_weight_bytes_quantized": after,  # packed weights + fp16 scales + zeros
        }

    def kv_record(self) -> dict | None:
        """The manifest's record of the FP8 KV-cache scales (None when not calibrated)."""
        if self.kv_scales is None:
            return None
        return kv_cache.scales_record(self.kv_scales, self.calibration)

    def install(self, hf_model) -> None:
        """Replace each quantized nn.Linear of ``hf_model`` by the plugin module that runs it
        (Int4Linear / Fp8Linear: the references eagerly, plugin nodes under ONNX export)."""
        for name, weights in self.linears.items():
            parent, _, attr = name.rpartition(".")
            setattr(hf_model.get_submodule(parent), attr, weights.module())


def quantize_source(
    source: WeightSource,
    config,
    tokenizer,
    method: str,
    group_size: int = 128,
    *,
    num_samples: int = 128,
    seq_len: int = 512,
    calibration_path: str | Path | None = None,
    calibration_name: str | None = None,
    act_order: bool = True,
    partial_groups: bool = False,
    kv_cache_scales: bool = False,
    device: str = "cpu",
    spill_dir: Path | None = None,
    batch_size: int = 8,
    fp8_error_feedback: bool = True,
    log: Callable[[str], None] | None = None,
) -> QuantizationResult:
    """Quantize every q/k/v/o/gate/up/down projection of the transformers model of ``config``
    whose weights ``source`` holds, one decoder layer at a time.

    ``method``: ``rtn`` (no calibration), ``awq``, ``gptq`` (INT4, ``group_size`` 32/64/128,
    which must divide every Linear's in_features unless ``partial_groups`` lets the last group
    of a row be shorter), ``fp8``, or ``none`` (nothing quantized: the KV-cache scales alone).
    Calibration text: the file at ``calibration_path`` (which the manifest's record and messages
    call ``calibration_name``, default the path as given) or the built-in text (see
    `calibration`), cut into ``num_samples`` windows of ``seq_len`` tokens; ``batch_size``
    windows run through a layer at once. ``act_order`` (GPTQ, static groups: the packed layout
    stays plain) and ``fp8_error_feedback`` (FP8 weights rounded with GPTQ's error feedback) are
    on by default; see `gptq` and `fp8`. ``kv_cache_scales``: also calibrate the FP8 KV-cache
    scales (`kv_cache`) on the fp model the artifact holds (AWQ-folded after AWQ).

    Memory: one decoder layer in fp32 and the calibration activations (``num_samples x seq_len
    x hidden_size`` fp32 per stream, see the module docstring), on ``device`` (``cpu`` or
    ``cuda``); never the model. Quantized layers go to ``spill_dir/layer{i}.safetensors`` when
    ``spill_dir`` is given (else memory) and are read back from there when
    `QuantizationResult.linears` is read; RTN's are computed from ``source`` when read, so
    ``source`` must stay readable while the result is used. ``log`` gets a line per layer.
    """
    if method not in (*METHODS, NONE):
        raise ValueError(
            f"quantization method {method!r} is not one of {', '.join((*METHODS, NONE))}"
        )
    stack = DecoderStack(config, source, calibration_device(device))
    return _quantize(
        stack,
        tokenizer,
        method,
        group_size,
        num_samples=num_samples,
        seq_len=seq_len,
        calibration_path=calibration_path,
        calibration_name=calibration_name,
        act_order=act_order,
        partial_groups=partial_groups,
        kv_cache_scales=kv_cache_scales,
        spill_dir=spill_dir,
        batch_size=batch_size,
        fp8_error_feedback=fp8_error_feedback,
        say=log or (lambda _msg: None),
    )


def quantize_model(
    hf_model,
    tokenizer,
    method: str,
    group_size: int = 128,
    *,
    num_samples: int = 128,
    seq_len: int = 512,
    calibration_path: str | None = None,
    act_order: bool = True,
    partial_groups: bool = False,
    fp8_error_feedback: bool = True,
    batch_size: int = 8,
    log: Callable[[str], None] | None = None,
) -> QuantizationResult:
    """`quantize_source` for a transformers model in memory (``method`` one of `METHODS`),
    calibrating in fp32 on the CPU; every quantized Linear is in ``result.linears`` on return.

    Side effects: for ``awq`` the fp weights of ``hf_model`` are modified IN PLACE: the AWQ
    scales are folded into the RMSNorm weights, the v_proj / up_proj output rows and the
    weight columns that read them, which leaves the fp function unchanged; build the model
    from these folded weights (the returned INT4 tensors quantize the scaled weights).
    Other methods leave ``hf_model`` as it was.
    """
    if method not in METHODS:
        raise ValueError(f"quantization method {method!r} is not one of {', '.join(METHODS)}")
    layers = decoder_layers(hf_model)

    def fold_into_model(index: int, layer: nn.Module) -> None:
        layers[index].load_state_dict(layer.state_dict())

    result = _quantize(
        DecoderStack(hf_model.config, StateDictSource(hf_model.state_dict())),
        tokenizer,
        method,
        group_size,
        num_samples=num_samples,
        seq_len=seq_len,
        calibration_path=calibration_path,
        calibration_name=None,
        act_order=act_order,
        partial_groups=partial_groups,
        kv_cache_scales=False,
        spill_dir=None,
        batch_size=batch_size,
        fp8_error_feedback=fp8_error_feedback,
        say=log or (lambda _msg: None),
        on_layer=fold_into_model if method == "awq" else None,
    )
    # RTN's are computed when read: read them now, from the weights as they are.
    result.linears = dict(result.linears)
    return result


def _algorithm(method: str, act_order: bool, fp8_error_feedback: bool) -> dict:
    return {
        NONE: {},
        "rtn": {"rounding": "nearest", "range": "min/max including 0"},
        "awq": {
            "alpha_grid": awq.N_GRID,
            "objective": "Linear outputs; MLP output for gate/up",
            "clip_search": True,
            "fold": "RMSNorm weights, v_proj and up_proj rows",
            "search_sample": f"at most {awq.SEARCH_TOKENS} tokens (clip search "
            f"{awq.CLIP_TOKENS}), uniform without replacement, "
            f"seed {awq.SAMPLE_SEED}",
        },
        "gptq": {
            "percdamp": 0.01,
            "block_size": gptq.BLOCK_SIZE,
            "act_order": act_order,
            "static_groups": act_order,
            "range_search_steps": gptq.SHRINK_STEPS,
            "range_search_error": "squared, weighted by diag(H)",
            "sequential": "layers, then q/k/v, o, gate/up, down",
        },
        "fp8": {
            "format": "e4m3fn",
            "weight_scale": "amax/448 per output channel",
            "input_scale": "calibration amax/448 per tensor",
            "weight_rounding": "gptq error feedback, percdamp 0.1"
            if fp8_error_feedback
            else "nearest",
        },
    }[method]


def _quantize(
    stack: DecoderStack,
    tokenizer,
    method: str,
    group_size: int,
    *,
    num_samples: int,
    seq_len: int,
    calibration_path: str | Path | None,
    calibration_name: str | None,
    act_order: bool,
    partial_groups: bool,
    kv_cache_scales: bool,
    spill_dir: Path | None,
    batch_size: int,
    fp8_error_feedback: bool,
    say: Callable[[str], None],
    on_layer: Callable[[int, nn.Module], None] | None = None,
) -> QuantizationResult:
    int4 = method in ("rtn", "awq", "gptq")
    shapes = {}
    if method != NONE:
        for i in range(stack.num_layers):
            for path in LINEARS:
                shapes[f"{LAYERS_PREFIX}.{i}.{path}"] = stack.linear_shape(i, path)
    if int4:
        for name, (_, k) in shapes.items():
            rtn.check_group_size(name, k, group_size, partial_groups)
    start = time.perf_counter()
    calib = (
        calibration_data(tokenizer, calibration_path, num_samples, seq_len, calibration_name)
        if method in CALIBRATED or kv_cache_scales
        else None
    )
    result = QuantizationResult(
        method,
        group_size if int4 else None,
        act_order and method == "gptq",
        partial_groups and int4,
        calib,
        stack.num_layers,
        linear_shapes=shapes,
        algorithm=_algorithm(method, act_order and method == "gptq", fp8_error_feedback),
    )
    store = None
    if method == "rtn":
        result.linears = QuantizedLinears(
            shapes, rtn_loader(stack.source, group_size, partial_groups)
        )
    elif method in CALIBRATED:
        store = LayerStore(spill_dir)
        result.linears = QuantizedLinears(shapes, store.load)
    if calib is not None:
        layers = run_layers(
            stack,
            calib.batches,
            batch_size,
            method,
            group_size=group_size,
            act_order=act_order,
            partial_groups=partial_groups,
            fp8_error_feedback=fp8_error_feedback,
            kv_cache_scales=kv_cache_scales,
            store=store,
            say=say,
            on_layer=on_layer,
        )
        result.overrides, result.kv_scales = layers.overrides, layers.kv_scales
    result.seconds = time.perf_counter() - start
    if method == "rtn":
        say(f"rtn: {len(shapes)} Linear layers, each quantized when it is read")
    elif method in CALIBRATED:
        say(f"{method}: {len(shapes)} Linear layers quantized in {result.seconds:.1f} s")
    if kv_cache_scales:
        say(f"kv scales: {stack.num_layers} layers calibrated")
    return result


@dataclass
class LayerResults:
    """What `run_layers` found besides the quantized Linears (which go to its store)."""

    overrides: dict[str, torch.Tensor]
    kv_scales: list[tuple[float, float]] | None


@torch.no_grad()
def run_layers(
    stack: DecoderStack,
    token_batches: list[list[int]],
    batch_size: int,
    method: str,
    *,
    group_size: int = 128,
    act_order: bool = True,
    partial_groups: bool = False,
    fp8_error_feedback: bool = True,
    kv_cache_scales: bool = False,
    store: LayerStore | None = None,
    say: Callable[[str], None] = lambda _msg: None,
    on_layer: Callable[[int, nn.Module], None] | None = None,
) -> LayerResults:
    """Stream the calibration windows ``token_batches`` through ``stack`` layer by layer:
    quantize each layer's Linears with ``method`` (a calibrated one; `rtn` and `none`
    quantize nothing here) into ``store``, and with ``kv_cache_scales`` take the KV-cache amax
    (over the model's heads). ``on_layer(i, layer)`` sees each layer once
    done (AWQ: folded), before it is dropped."""
    n = stack.num_layers
    fp8_feedback = method == "fp8" and fp8_error_feedback
    inputs = stack.calibration_inputs(token_batches, batch_size)
    fp, quantized_stream, folded = _streams(inputs, method, kv_cache_scales, fp8_feedback)
    samples, amax = None, dict.fromkeys(LINEARS, 0.0)
    label = method if method in CALIBRATED else "kv scales"
    overrides: dict[str, torch.Tensor] = {}
    kv_scales: list[tuple[float, float]] = []
    for i in range(n):
        t0 = time.perf_counter()
        layer = stack.layer(i)
        prefix = f"{LAYERS_PREFIX}.{i}"
        kv = kv_cache.KVAmax(stack.head_dim) if kv_cache_scales else None
        if fp is not None:  # the fp layer, before the method changes it
            samples, amax = _fp_pass(
                layer, inputs.for_layer(i, fp), method, kv if method != "awq" else None
            )
        quantized = _quantize_layer(
            layer,
            method,
            samples,
            None if quantized_stream is None else inputs.for_layer(i, quantized_stream),
            group_size=group_size,
            act_order=act_order,
            partial_groups=partial_groups,
            fp8_feedback=fp8_feedback,
        )
        if method == "awq":
            for name, weight in awq.folded_norms(layer).items():
                overrides[f"{prefix}.{name}"] = weight.detach().float().cpu().clone()
            if folded is not None:
                with hooks(kv.hooks(layer)):
                    run_layer(layer, inputs.for_layer(i, folded))
        if quantized is not None and store is not None:
            store.put(
                i,
                {
                    f"{prefix}.{p}": _weights(linear(layer, p), quantized[p], group_size, amax[p])
                    for p in LINEARS
                },
            )
        if kv is not None:
            kv_scales.append(kv.scales())
        if on_layer is not None:
            on_layer(i, layer)
        del layer
        say(f"{label}: layer {i + 1}/{n} in {time.perf_counter() - t0:.1f} s")
    return LayerResults(overrides, kv_scales if kv_cache_scales else None)


def _streams(
    inputs: CalibrationInputs, method: str, kv_cache_scales: bool, fp8_feedback: bool
) -> tuple:
    """The streams (see the module docstring) that ``method`` and the KV-cache scales read,
    as ``(fp, quantized, folded)``, each None when nothing reads it. They share layer 0's
    inputs until they part; ``inputs.first`` lets go of its own reference to them."""
    fp = (
        list(inputs.first)
        if method in ("awq", "fp8") or (kv_cache_scales and method != "awq")
        else None
    )
    quantized = list(inputs.first) if method == "gptq" or fp8_feedback else None
    folded = list(inputs.first) if method == "awq" and kv_cache_scales else None
    inputs.first = []
    return fp, quantized, folded


def _quantize_layer(
    layer: nn.Module,
    method: str,
    samples: dict[str, awq.ActivationSample] | None,
    quantized_inputs: LayerInputs | None,
    *,
    group_size: int,
    act_order: bool,
    partial_groups: bool,
    fp8_feedback: bool,
) -> dict | None:
    """The layer's Linears quantized with ``method`` (by path), or None for a method that
    quantizes nothing here. AWQ folds its scales into ``layer`` (from the fp stream's
    ``samples``); GPTQ and FP8's error feedback calibrate on ``quantized_inputs``."""
    if method == "awq":
        return awq.awq_layer(layer, samples, group_size, partial_groups=partial_groups)
    if method == "gptq":
        quantizer = gptq.int4_quantizer(
            group_size, act_order=act_order, partial_groups=partial_groups
        )
        return gptq.gptq_layer(layer, quantized_inputs, quantizer)
    if fp8_feedback:
        return gptq.gptq_layer(layer, quantized_inputs, gptq.fp8_quantizer())
    if method == "fp8":
        return {p: fp8.quantize_weight_fp8(linear(layer, p).weight) for p in LINEARS}
    return None


def _fp_pass(
    layer: nn.Module, inputs: LayerInputs, method: str, kv: kv_cache.KVAmax | None
) -> tuple[dict[str, awq.ActivationSample] | None, dict[str, float]]:
    """Advance the fp stream through the unchanged layer, taking what the method reads from
    it: AWQ's activation samples, FP8's input amax per Linear; and the KV-cache amax into
    ``kv``. Returns ``(samples or None, {path: amax})``."""
    samples = awq.new_samples(inputs.num_tokens) if method == "awq" else None
    amax = dict.fromkeys(LINEARS, 0.0)

    def on_input(path: str, x: torch.Tensor) -> None:
        if samples is not None and path in samples:
            samples[path].add(x)
        if method == "fp8":
            amax[path] = max(amax[path], x.abs().max().item())

    paths = LINEARS if method == "fp8" else tuple(samples) if samples is not None else ()
    handles = input_hooks(layer, paths, on_input) + ([] if kv is None else kv.hooks(layer))
    with hooks(handles):
        run_layer(layer, inputs)
    return samples, amax


def _weights(lin: nn.Linear, quantized: tuple, group_size: int, amax: float) -> Weights:
    """A Linear's quantized tensors (on the CPU), its bias as the layer now holds it."""
    bias = None if lin.bias is None else lin.bias.detach().float().cpu().clone()
    if quantized[0].dtype == torch.float8_e4m3fn:
        weight, weight_scale = quantized
        return Fp8Weights(weight.cpu(), weight_scale.cpu(), fp8.input_scale(amax), bias)
    q, scales, zeros = quantized
    return Int4Weights(pack_int4(q).cpu(), scales.cpu(), zeros.cpu(), bias, group_size)
