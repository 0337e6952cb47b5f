"""FP8 E4M3 quantization for `trtc::Fp8Gemm`.

* Weights: per output channel, ``weight_scale[n] = max_k |W[n, k]| / 448`` (448 is E4M3's
  largest finite value), ``weight = fp8(W / weight_scale[:, None])``: each row uses the whole
  E4M3 range, and no weight saturates.
  By default (`apply.quantize_source`, ``fp8_error_feedback=True``) the weights are rounded to
  that same grid with GPTQ's error feedback (`gptq.gptq_fp8`) instead of independently: the
  scales and the format are unchanged, each weight's choice between its two neighbouring E4M3
  values accounts for the rounding of the columns before it. E4M3 keeps only 3 mantissa bits,
  coarse enough that compensating each rounding pays on a small model (docs/quantization.md,
  "FP8 weights: error-feedback damping").
* Activations: one static scale per Linear input, ``input_scale = amax / 448`` with ``amax`` the
  largest |x| that Linear saw over the calibration set (fp model, every layer fed the fp
  outputs of the layer before it). Larger values at serving time saturate (the Fp8Gemm
  contract).
"""

from __future__ import annotations

import torch

from trtc.plugins.fp8_gemm.reference import E4M3_MAX, to_fp8


def _scale(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> ``(float8_e4m3fn [N, K], weight_scale fp32 [N])``."""
    w = weight.detach().float()
    scale = _scale(w.abs().amax(dim=1))
    return to_fp8(w / scale[:, None]), scale


def input_scale(amax: float) -> torch.Tensor:
    """The per-tensor activation scale (fp32 scalar) for a calibrated ``amax``."""
    return _scale(torch.tensor(float(amax)))
