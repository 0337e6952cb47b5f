"""One entry point: quantize the Linear layers of a transformers decoder.

`quantize_model` returns the quantized tensors of every q/k/v/o/gate/up/down projection of
every decoder layer (never the embeddings or the LM head), named as in the state dict
(``model.layers.3.mlp.down_proj``), plus `QuantizationResult.record`, the manifest's
quantization section.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from trtc.compiler.quantize import awq, fp8, gptq, rtn
from trtc.compiler.quantize.calibration import CalibrationData, calibration_data
from trtc.compiler.quantize.layers import LINEARS, ModelInputs, decoder_layers, linear, run_layer
from trtc.plugins.fp8_gemm import Fp8Linear
from trtc.plugins.int4_gemm import Int4Linear, pack_int4
from trtc.plugins.int4_gemm import dequantize as int4_dequantize

METHODS = ("rtn", "awq", "gptq", "fp8")


@dataclass
class Int4Weights:
    """Inputs of one `trtc::Int4Gemm` node (scales fp32 here: cast to the model dtype)."""

    qweight: torch.Tensor  # uint8 [N, K/2], low nibble = even k
    scales: torch.Tensor  # fp32 [N, ceil(K/g)]
    zeros: torch.Tensor  # uint8 [N, ceil(K/g)], 0..15
    bias: torch.Tensor | None  # [N] or None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    def dequantize(self) -> torch.Tensor:
        return int4_dequantize(self.qweight, self.scales, self.zeros, self.group_size)

    def nbytes(self, scale_bytes: int = 2) -> int:
        return self.qweight.numel() + self.scales.numel() * scale_bytes + self.zeros.numel()

    def module(self) -> Int4Linear:
        return Int4Linear(self.qweight, self.scales, self.zeros, self.bias, self.group_size)


@dataclass
class Fp8Weights:
    """Inputs of one `trtc::Fp8Gemm` node."""

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor  # fp32 [N]
    input_scale: torch.Tensor  # fp32 []
    bias: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    def nbytes(self) -> int:
        return self.weight.numel() + self.weight_scale.numel() * 4 + 4

    def module(self) -> Fp8Linear:
        return Fp8Linear(self.weight, self.weight_scale, self.input_scale, self.bias)


@dataclass
class QuantizationResult:
    method: str
    group_size: int | None  # None for fp8
    act_order: bool
    partial_groups: bool
    calibration: CalibrationData | None  # None for rtn
    num_decoder_layers: int
    linears: dict[str, Int4Weights | Fp8Weights] = field(default_factory=dict)
    algorithm: dict = field(default_factory=dict)  # the method's settings, for the manifest
    seconds: float = 0.0

    @property
    def bits(self) -> int:
        return 8 if self.method == "fp8" else 4

    def record(self) -> dict:
        """The manifest's quantization section (deterministic: no timings)."""
        before = sum(2 * n * k for n, k in (w.shape for w in self.linears.values()))
        after = sum(w.nbytes() for w in self.linears.values())
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
            "calibration": None if self.calibration is None else self.calibration.record(),
            "num_decoder_layers": self.num_decoder_layers,
            "num_linears_quantized": len(self.linears),
            "linear_weight_bytes_fp16": before,
            "linear_weight_bytes_quantized": after,  # packed weights + fp16 scales + zeros
        }

    def install(self, hf_model) -> None:
        """Replace each quantized nn.Linear of ``hf_model`` by the plugin module that runs it
        (Int4Linear / Fp8Linear: the references eagerly, plugin nodes under ONNX export)."""
        for name, weights in self.linears.items():
            parent, _, attr = name.rpartition(".")
            setattr(hf_model.get_submodule(parent), attr, weights.module())


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
    """Quantize every q/k/v/o/gate/up/down projection of ``hf_model``.

    ``method``: ``rtn`` (no calibration), ``awq``, ``gptq`` (INT4, ``group_size`` 32/64/128,
    which must divide every Linear's in_features unless ``partial_groups`` lets the last group
    of a row be shorter) or ``fp8``. Calibration text: the file at
    ``calibration_path`` or the built-in text (see `calibration`), cut into ``num_samples``
    windows of ``seq_len`` tokens. ``act_order`` (GPTQ, static groups: the packed layout stays
    plain) and ``fp8_error_feedback`` (FP8 weights rounded with GPTQ's error feedback) are on
    by default; see `gptq` and `fp8`. ``batch_size`` sequences run through a layer at once.

    Side effects: for ``awq`` the fp weights of ``hf_model`` are modified IN PLACE: the AWQ
    scales are folded into the RMSNorm weights, the v_proj / up_proj output rows and the
    weight columns that read them, which leaves the fp function unchanged; build the model
    from these folded weights (the returned INT4 tensors quantize the scaled weights).
    Other methods leave ``hf_model`` as it was (GPTQ restores each layer after use).
    """
    say = log or (lambda _msg: None)
    if method not in METHODS:
        raise ValueError(f"quantization method {method!r} is not one of {', '.join(METHODS)}")
    layers = decoder_layers(hf_model)
    if method != "fp8":
        for i, layer in enumerate(layers):
            for path in LINEARS:
                rtn.check_group_size(
                    f"model.layers.{i}.{path}",
                    linear(layer, path).in_features,
                    group_size,
                    partial_groups,
                )
    start = time.perf_counter()
    was_training = hf_model.training
    hf_model.eval()
    calib = (
        None
        if method == "rtn"
        else calibration_data(tokenizer, calibration_path, num_samples, seq_len)
    )
    int4 = method != "fp8"
    result = QuantizationResult(
        method,
        group_size if int4 else None,
        act_order and method == "gptq",
        partial_groups and int4,
        calib,
        len(layers),
    )
    result.algorithm = {
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
            "act_order": result.act_order,
            "static_groups": result.act_order,
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
    try:
        with torch.no_grad():
            if method == "fp8":
                _fp8(hf_model, layers, calib, batch_size, fp8_error_feedback, say, result)
            else:
                _int4(
                    hf_model,
                    layers,
                    method,
                    group_size,
                    calib,
                    batch_size,
                    act_order,
                    partial_groups,
                    say,
                    result,
                )
    finally:
        hf_model.train(was_training)
    result.seconds = time.perf_counter() - start
    say(f"{method}: {len(result.linears)} Linear layers quantized in {result.seconds:.1f} s")
    return result


def _bias(lin: nn.Linear) -> torch.Tensor | None:
    return None if lin.bias is None else lin.bias.detach().float().clone()


def _int4(
    hf_model, layers, method, group_size, calib, batch_size, act_order, partial_groups, say, result
):
    inputs = None if calib is None else ModelInputs(hf_model, calib.batches, batch_size)
    hidden = None if inputs is None else inputs.first.hidden
    for i, layer in enumerate(layers):
        t0 = time.perf_counter()
        if method == "rtn":
            quantized = {
                p: rtn.quantize_rtn(
                    linear(layer, p).weight, group_size, p, partial_groups=partial_groups
                )
                for p in LINEARS
            }
        elif method == "awq":
            layer_inputs = inputs.for_layer(i, hidden)
            next_hidden = run_layer(layer, layer_inputs)
            quantized = awq.awq_layer(
                layer, layer_inputs, group_size, partial_groups=partial_groups
            )
            hidden = next_hidden
        else:
            quantized, hidden = gptq.gptq_layer(
                layer,
                inputs.for_layer(i, hidden),
                gptq.int4_quantizer(group_size, act_order=act_order, partial_groups=partial_groups),
            )
        for path, (q, scales, zeros) in quantized.items():
            result.linears[f"model.layers.{i}.{path}"] = Int4Weights(
                pack_int4(q), scales, zeros, _bias(linear(layer, path)), group_size
            )
        if method != "rtn":
            say(f"{method}: layer {i + 1}/{len(layers)} in {time.perf_counter() - t0:.1f} s")


def _fp8(hf_model, layers, calib, batch_size, error_feedback, say, result):
    amax = fp8.calibrate_input_amax(hf_model, calib.batches, batch_size)
    if error_feedback:
        inputs = ModelInputs(hf_model, calib.batches, batch_size)
        hidden = inputs.first.hidden
    for i, layer in enumerate(layers):
        t0 = time.perf_counter()
        if error_feedback:
            quantized, hidden = gptq.gptq_layer(
                layer, inputs.for_layer(i, hidden), gptq.fp8_quantizer()
            )
        else:
            quantized = {p: fp8.quantize_weight_fp8(linear(layer, p).weight) for p in LINEARS}
        for path, (weight, weight_scale) in quantized.items():
            name = f"model.layers.{i}.{path}"
            result.linears[name] = Fp8Weights(
                weight, weight_scale, fp8.input_scale(amax[name]), _bias(linear(layer, path))
            )
        if error_feedback:
            say(f"fp8: layer {i + 1}/{len(layers)} in {time.perf_counter() - t0:.1f} s")
