"""torch implementations of the ONNX ops a trtc graph holds, for the torch executor.

Each takes ``(inputs, attrs)`` and returns a list of outputs. Semantics follow the ONNX spec
(opset 23) restricted to what trtc graphs use; anything else is refused when the executor loads
the graph, never silently approximated. Plugin ops (domain ``trtc``) dispatch to the plugin's
implementation for the device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtc.plugins.paged_attention import paged_attention
from trtc.runtime.executors.graph import OpTable

ONNX_TO_TORCH = {
    1: torch.float32,
    10: torch.float16,
    16: torch.bfloat16,
    7: torch.int64,
    6: torch.int32,
    9: torch.bool,
    11: torch.float64,
    17: torch.float8_e4m3fn,
}


def gemm(x, attrs):
    a, b = x[0], x[1]
    if attrs.get("transA", 0):
        a = a.t()
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    bias = x[2] if len(x) > 2 and x[2] is not None else None
    if attrs.get("transB", 0) and alpha == 1.0 and beta == 1.0:
        if a.is_cuda:
            from trtc.plugins.kernels import gemv

            if gemv.supports(a, b) and (bias is None or bias.dtype == a.dtype):
                return [gemv.gemv(a, b, bias)]  # a decode step's few tokens
        return [F.linear(a, b, bias)]  # weights stay [out, in], as stored
    y = alpha * (a @ (b.t() if attrs.get("transB", 0) else b))
    return [y + beta * bias if bias is not None else y]


def rms_norm(x, attrs):
    inp, scale = x[0], x[1]
    stash = ONNX_TO_TORCH[attrs.get("stash_type", 1)]
    axis = attrs.get("axis", -1)
    if inp.is_cuda and stash == torch.float32 and axis % inp.dim() == inp.dim() - 1:
        from trtc.plugins.kernels import pointwise

        return [pointwise.rms_norm(inp, scale, attrs.get("epsilon", 1e-5))]
    dims = tuple(range(axis % inp.dim(), inp.dim()))
    xf = inp.to(stash)
    y = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + attrs.get("epsilon", 1e-5))
    return [(y.to(inp.dtype) * scale).to(scale.dtype)]


def _rotary(x, attrs):
    """ONNX RotaryEmbedding, 3-D input ``[batch, seq, heads*D]`` with position ids."""
    inp, cos_cache, sin_cache = x[0], x[1], x[2]
    positions = x[3] if len(x) > 3 else None
    if inp.dim() != 3 or positions is None or attrs.get("interleaved", 0):
        raise NotImplementedError("RotaryEmbedding: only 3-D, position-indexed, non-interleaved")
    batch, seq, hidden = inp.shape
    heads = attrs["num_heads"]
    head_dim = hidden // heads
    rot = attrs.get("rotary_embedding_dim", 0) or head_dim
    if inp.is_cuda and rot == head_dim:
        from trtc.plugins.kernels import pointwise

        return [pointwise.rotary(inp, cos_cache, sin_cache, positions, heads)]
    v = inp.view(batch, seq, heads, head_dim)
    cos = cos_cache[positions].unsqueeze(2)  # [batch, seq, 1, rot/2]
    sin = sin_cache[positions].unsqueeze(2)
    half = rot // 2
    x1, x2, rest = v[..., :half], v[..., half:rot], v[..., rot:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    return [out.view(batch, seq, hidden)]


def _split(x, attrs):
    axis = attrs.get("axis", 0)
    if len(x) > 1 and x[1] is not None:
        return list(torch.split(x[0], x[1].tolist(), dim=axis))
    return list(torch.chunk(x[0], attrs["num_outputs"], dim=axis))


def _reshape(x, attrs):
    shape = [int(d) for d in x[1].tolist()]
    if not attrs.get("allowzero", 0):
        shape = [x[0].shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return [x[0].reshape(shape)]


def _unsqueeze(x, attrs):
    out = x[0]
    for axis in sorted(int(a) for a in x[1].tolist()):
        out = out.unsqueeze(axis)
    return [out]


def _squeeze(x, attrs):
    out = x[0]
    for axis in sorted((int(a) % x[0].dim() for a in x[1].tolist()), reverse=True):
        out = out.squeeze(axis)
    return [out]


def _gather(x, attrs):
    axis = attrs.get("axis", 0)
    return [
        torch.index_select(x[0], axis, x[1].reshape(-1)).reshape(
            x[0].shape[:axis] + x[1].shape + x[0].shape[axis + 1 :]
        )
    ]


def swiglu(x, attrs):
    if x[0].is_cuda:
        from trtc.plugins.kernels import pointwise

        return [pointwise.swiglu(x[0])]
    gate, up = x[0].chunk(2, dim=-1)
    return [F.silu(gate) * up]


def _paged_attention(x, attrs):
    out, cache = paged_attention(*x, **attrs)  # the entry point fills the spec's defaults
    return [out, cache]


def _int4_gemm(x, attrs):
    from trtc.plugins.int4_gemm import int4_gemm

    return [
        int4_gemm(
            *x,
            group_size=attrs["group_size"],
            in_features=attrs["in_features"],
            out_features=attrs["out_features"],
        )
    ]


def _fp8_gemm(x, attrs):
    from trtc.plugins.fp8_gemm import fp8_gemm

    return [fp8_gemm(*x, in_features=attrs["in_features"], out_features=attrs["out_features"])]


def _all_reduce(x, attrs):
    from trtc.plugins.all_reduce import all_reduce

    return [all_reduce(*x, world_size=attrs["world_size"])]


ONNX_OPS: OpTable = {
    ("", "Gemm"): gemm,
    ("", "MatMul"): lambda x, a: [x[0] @ x[1]],
    ("", "Add"): lambda x, a: [x[0] + x[1]],
    ("", "Mul"): lambda x, a: [x[0] * x[1]],
    ("", "Cast"): lambda x, a: [x[0].to(ONNX_TO_TORCH[a["to"]])],
    ("", "Identity"): lambda x, a: [x[0]],
    ("", "RMSNormalization"): rms_norm,
    ("", "RotaryEmbedding"): _rotary,
    ("", "Split"): _split,
    ("", "Reshape"): _reshape,
    ("", "Unsqueeze"): _unsqueeze,
    ("", "Squeeze"): _squeeze,
    ("", "Gather"): _gather,
    ("trtc", "SwiGLU"): swiglu,
    ("trtc", "PagedAttention"): _paged_attention,
    ("trtc", "Int4Gemm"): _int4_gemm,
    ("trtc", "Fp8Gemm"): _fp8_gemm,
    ("trtc", "AllReduce"): _all_reduce,
}
