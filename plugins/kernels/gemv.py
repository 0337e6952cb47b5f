"""A Triton GEMV for the dense (fp16/bf16) Gemm nodes of decode steps with a few tokens: ``y = x
@ W.T + b`` (ONNX Gemm with transB = 1, F.linear's semantics: fp32 accumulation, the result
rounded once to x's dtype).

At one token a projection is a stream of its weight bytes, and what it costs beyond the bytes is
the ramp at its start and the tail at its end. So each program owns ``ROWS`` whole rows: it loads
them (all of K at once, one tile) *before* waiting for the kernel that produces x (programmatic
dependent launch, `trtc.plugins.kernels.pdl`), so the weight reads of a projection overlap the
end of the kernel before it; after the wait it reads x (from L2), multiplies, reduces each row
and writes it. No split over K and no partial sums: one launch, deterministic.

K is padded to a power of two in the tile (masked lanes read nothing); a program holds ``TILE``
weights. The MLP's gate/up projection can end in SwiGLU (``swiglu``: a program owns row j of the
gate and row j of the up half and writes SwiGLU's output j; the CUDA executor fuses ``Gemm ->
SwiGLU`` into it, runtime/executors/fusions/gemm_swiglu.py), one kernel and one round trip of the
2 x MLP wide intermediate fewer per layer. Measurements: docs/gpu-kernels.md, "Dense GEMV for
few-token decode steps".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtc import envs
from trtc.plugins.kernels import pdl

# Above this many tokens the projections go to cuBLAS (each token costs a pass of FMAs over the
# tile; docs/gpu-kernels.md measures where the GEMV stops paying). None: TRTC_GEMV_MAX_TOKENS,
# read at the first call; `set_max_tokens` changes it (benchmarks compare settings with it).
_max_tokens: int | None = None


def max_tokens() -> int:
    global _max_tokens
    if _max_tokens is None:
        _max_tokens = envs.TRTC_GEMV_MAX_TOKENS
    return _max_tokens


def set_max_tokens(tokens: int) -> int:
    """Calls from now on take the GEMV up to ``tokens`` rows (0: never). Returns the previous
    setting."""
    global _max_tokens
    was, _max_tokens = max_tokens(), tokens
    return was


TILE = 8192  # weights per program (ROWS x K_P2): 64 a thread at 4 warps, 32 at 8


@triton.jit
def _weight_rows(w_ptr, b_ptr, rows, row_ok, cols, col_ok, K, HAS_BIAS: tl.constexpr):
    w = tl.load(
        w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
        mask=row_ok[:, None] & col_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    bias = tl.zeros_like(rows).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    return w, bias


@triton.jit
def _gemv(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_x,
    TOKENS: tl.constexpr,
    ROWS: tl.constexpr,
    K_P2: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    PDL: tl.constexpr,
):
    """``ROWS`` outputs of every token. With ``SWIGLU`` the weight has 2N rows (gate, then up)
    and output j is SwiGLU of rows j and N + j, computed as the Gemm then `torch_ops.swiglu`
    compute it (each product rounded to y's dtype first)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, K_P2)
    row_ok = rows < N
    col_ok = cols < K
    # Weights (and bias) are constants: read them before waiting for the previous kernel.
    w, bias = _weight_rows(w_ptr, b_ptr, rows, row_ok, cols, col_ok, K, HAS_BIAS)
    if SWIGLU:
        w_up, bias_up = _weight_rows(w_ptr, b_ptr, rows + N, row_ok, cols, col_ok, K, HAS_BIAS)
    pdl.begin(PDL)
    ty = y_ptr.dtype.element_ty
    for t in tl.static_range(TOKENS):
        x = tl.load(x_ptr + t * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = (tl.sum(w * x[None, :], axis=1) + bias).to(ty)
        if SWIGLU:
            up = (tl.sum(w_up * x[None, :], axis=1) + bias_up).to(ty)
            gate = y.to(tl.float32)
            y = (gate / (1.0 + tl.exp(-gate))).to(ty) * up
        tl.store(y_ptr + t * N + rows, y, mask=row_ok)


def supports(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False) -> bool:
    """Whether `gemv` takes ``x [T, K] @ weight[N, K].T``: CUDA, fp16/bf16, at most
    `max_tokens()` rows (any row stride, unit column stride), K at most one tile wide."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.stride(1) == 1
        and 0 < x.shape[0] <= max_tokens()
        and weight.dim() == 2
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and x.shape[1] == weight.shape[1]
        and (not swiglu or weight.shape[0] % 2 == 0)
        and triton.next_power_of_2(weight.shape[1]) <= TILE
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    swiglu: bool = False,
    rows: int | None = None,
    num_warps: int | None = None,
    use_pdl: bool | None = None,
) -> torch.Tensor:
    """``x [T, K] @ weight[N, K].T (+ bias)`` in x's dtype (`supports` must hold); with
    ``swiglu`` (N even), ``SwiGLU`` of that product (`pointwise.swiglu`: silu of the first half
    times the second), ``[T, N/2]``. ``rows`` and ``num_warps`` override the tile (the benchmark's
    variants), ``use_pdl`` the module default."""
    tokens = x.shape[0]
    n, k = weight.shape
    if swiglu:
        n //= 2
    # 8 warps at one token (faster than 4 there), 4 at two (docs/gpu-kernels.md, "Dense GEMV for
    # few-token decode steps").
    num_warps = num_warps or (8 if tokens == 1 else 4)
    k_p2 = triton.next_power_of_2(k)
    rows = rows or max(1, TILE // k_p2 // (2 if swiglu else 1))
    weight = weight.contiguous()
    y = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    launch = dict(pdl.launch_options(x.device, use_pdl), num_warps=num_warps)
    _gemv[(triton.cdiv(n, rows),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        x.stride(0),
        TOKENS=tokens,
        ROWS=rows,
        K_P2=k_p2,
        HAS_BIAS=bias is not None,
        SWIGLU=swiglu,
        **launch,
    )
    return y
