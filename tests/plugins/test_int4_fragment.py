"""The Int4Gemm fragment kernel (`plugins/int4_gemm/fragment_kernel.py`) against the reference:
its weight layout on the CPU, the kernel in Triton's CPU interpreter at small sizes (the portable
version of the same addressing and sums), and on a GPU (marker `gpu`) the inline-PTX mma
kernel at the Llama-7B projection sizes."""

from __future__ import annotations

import pytest
import torch

from harness.int4_layers import DEVICE, make_layer
from harness.sm90_compile import run_probe
from trtc.plugins.int4_gemm.reference import dequantize, unpack_int4

fragment_kernel = pytest.importorskip(
    "trtc.plugins.int4_gemm.fragment_kernel", reason="triton is not installed"
)


def decode_words(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The 4-bit values ``[N, K]`` of a fragment layout, by the module docstring's rule
    (row = 16 r + g + 8 (m & 1), col = 64 b + 16 c + 4 u + 2 ((m >> 1) & 1) + (m >> 2))."""
    w = words.to(torch.int64) & 0xFFFFFFFF  # [r, b, lane, u]
    out = torch.empty(n, k, dtype=torch.int64)
    r, b, lane, u, m = torch.meshgrid(*(torch.arange(s) for s in (*w.shape, 8)), indexing="ij")
    g, c = lane // 4, lane % 4
    rows = 16 * r + g + 8 * (m & 1)
    cols = 64 * b + 16 * c + 4 * u + 2 * ((m >> 1) & 1) + (m >> 2)
    out[rows.reshape(-1), cols.reshape(-1)] = ((w[..., None] >> (4 * m)) & 0xF).reshape(-1)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fragment_layout_holds_every_weight_once(dtype):
    n, k, group = 48, 384, 128
    qweight, scales, zeros, _ = make_layer(n, k, group, dtype, False, seed=3, device="cpu")
    fw = fragment_kernel.fragment_pack(qweight, scales, zeros, group)
    assert fw.words.shape == (n // 16, k // 64, 32, 4) and fw.words.dtype == torch.int32
    assert torch.equal(decode_words(fw.words, n, k), unpack_int4(qweight).to(torch.int64))
    # records [tiles, groups, g, 4] in x's dtype: the offsets of row g and row g + 8 (fp16:
    # -(1024 + z), -(64 + z); bf16: -(128 + z) both), both rows' scales
    lo, hi = (1024, 64) if dtype == torch.float16 else (128, 128)
    assert fw.records.dtype == dtype
    rec = fw.records.float()
    z, s = zeros.float().view(n // 16, 2, 8, -1), scales.float().view(n // 16, 2, 8, -1)
    assert torch.equal(rec[..., 0], -(lo + z[:, 0]).transpose(1, 2))
    assert torch.equal(rec[..., 1], -(hi + z[:, 1]).transpose(1, 2))
    assert torch.equal(rec[..., 2], s[:, 0].transpose(1, 2))
    assert torch.equal(rec[..., 3], s[:, 1].transpose(1, 2))
    assert fw.nbytes == qweight.numel() + n * (k // group) * 4


@pytest.mark.parametrize(
    "n, k, group, why",
    [
        (40, 256, 128, "out_features 40"),
        (32, 320, 128, "in_features 320"),
        (32, 256, 32, "group size 32"),
    ],
)
def test_fragment_layout_refuses_what_the_kernel_cannot_take(n, k, group, why):
    qweight, scales, zeros, _ = make_layer(n, k, group, torch.float16, False, seed=0, device="cpu")
    assert why in fragment_kernel.fragment_supports(n, k, group)
    with pytest.raises(ValueError, match=why):
        fragment_kernel.fragment_pack(qweight, scales, zeros, group)
    assert fragment_kernel.fragment_plan(1, n, k, group) is None


def test_fragment_plan_follows_the_measurements():
    plan = fragment_kernel.fragment_plan
    assert plan(1, 4096, 4096, 128).warps_k == 4
    assert plan(8, 11008, 4096, 128).warps_k == 4
    assert plan(1, 4096, 11008, 128).warps_k == 8
    assert plan(1, 4096, 12288, 128).warps_k == 8  # 96 steps a lane: the most
    # two mma's: a lane's share at most 48 steps, except on layers of many tiles
    assert plan(16, 4096, 4096, 128).warps_k == 8
    assert plan(16, 11008, 4096, 128).warps_k == 4
    assert plan(9, 4096, 11008, 128).warps_k == 8
    assert plan(16, 2560, 2048, 128).warps_k == 4
    assert plan(16, 2048, 5632, 128).warps_k == 8
    assert plan(17, 64, 256, 128) is None
    # calls of up to 32 tokens: launches of 16; above, none (prefill: fragment_matmul)
    launches = fragment_kernel.fragment_launches
    assert [(a, b) for a, b, _ in launches(27, 4096, 4096, 128)] == [(0, 16), (16, 27)]
    assert launches(27, 4096, 4096, 128)[1][2] == plan(11, 4096, 4096, 128)
    assert launches(33, 4096, 4096, 128) is None
    # rows whose share a lane's registers cannot hold at 8 warps (13B's and 70B's down
    # projections) stay on the plugin's layout
    for k in (13824, 28672):
        assert "too long" in fragment_kernel.fragment_supports(8192, k, 128)
        assert plan(1, 8192, k, 128) is None and launches(1, 8192, k, 128) is None


def run(tokens, n, k, group, bias, plan=None, seed=0, dtype=torch.float16):
    qweight, scales, zeros, b = make_layer(n, k, group, dtype, bias, seed)
    fw = fragment_kernel.fragment_pack(qweight, scales, zeros, group)
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    x = torch.randn(tokens, k, generator=g, device=DEVICE).to(dtype)
    out = torch.full((tokens, n), float("nan"), dtype=dtype, device=DEVICE)
    got = fragment_kernel.int4_gemm_fragment(x, fw, b, plan=plan, out=out)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(got).any()
    w = dequantize(qweight, scales, zeros, group).double()
    exact = x.double() @ w.T + (b.double() if bias else 0)
    return float((got.double() - exact).norm() / exact.norm())


# Small enough for the interpreter: a warp with no groups (2 groups, 4 warps), a tile past N
# (3 tiles, 2 a program), odd token counts, the second mma's tokens, group 64 and 256.
@pytest.mark.parametrize(
    "tokens, n, k, group, bias, plan",
    [
        (1, 32, 256, 128, False, None),
        (3, 48, 256, 128, True, fragment_kernel.FragmentPlan(tiles=2, warps_k=4)),
        (5, 16, 512, 64, False, fragment_kernel.FragmentPlan(tiles=1, warps_k=2)),
        (11, 32, 512, 256, True, None),
    ],
)
def test_fragment_kernel_matches_reference(tokens, n, k, group, bias, plan):
    assert run(tokens, n, k, group, bias, plan) < 1e-3


def test_fragment_kernel_in_launches_matches_reference():
    # 27 tokens: a two-mma launch of 16 and one of 11 (plan=None: fragment_launches)
    assert run(27, 32, 256, 128, True) < 1e-3


@pytest.mark.parametrize("tokens, bias", [(1, False), (11, True), (27, False), (40, True)])
def test_swiglu_in_the_epilogue_gives_the_unfused_bits(tokens, bias):
    """A gate/up weight with its rows interleaved and SwiGLU in the kernel's epilogue (one mma,
    two, launches of 16; 40 tokens: the dequantized layer and cuBLAS) = the plain layout's
    Int4Gemm, then SwiGLU, bit for bit."""
    from trtc.plugins.kernels import pointwise

    n, k, group = 64, 256, 128
    qweight, scales, zeros, b = make_layer(n, k, group, torch.float16, bias, seed=5)
    plain = fragment_kernel.fragment_pack(qweight, scales, zeros, group)
    il = fragment_kernel.interleave_gate_up
    mixed = fragment_kernel.fragment_pack(il(qweight), il(scales), il(zeros), group)
    g = torch.Generator(device=DEVICE).manual_seed(6)
    x = torch.randn(tokens, k, generator=g, device=DEVICE).to(torch.float16)
    want = pointwise.swiglu(fragment_kernel.fragment_gemm(x, plain, b))
    got = fragment_kernel.fragment_gemm_swiglu(
        x, mixed, pointwise.swiglu, None if b is None else il(b)
    )
    assert got.shape == (tokens, n // 2)
    assert torch.equal(got, want)
    # the interleaving: tile r holds gate rows 8r..8r+7, then up rows 8r..8r+7
    rows = il(torch.arange(n))
    assert rows[:16].tolist() == [*range(8), *range(32, 40)]
    assert torch.equal(
        fragment_kernel.deinterleave_gate_up(il(torch.arange(n))[None]), torch.arange(n)[None]
    )


def rotary_case(tokens, bias, cache_dtype, seed=7):
    """A merged q/k/v layer (4 q heads, 2 kv heads of 32), its rotary operands and a cache of
    16-token blocks; the third token (where there is one) is padding (slot -1)."""
    from trtc.plugins.kernels import pointwise

    heads, kv_heads, d = 4, 2, 32
    n, k, group = (heads + 2 * kv_heads) * d, 256, 128
    layer = make_layer(n, k, group, torch.float16, bias, seed=seed)
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    x = torch.randn(tokens, k, generator=g, device=DEVICE).to(torch.float16)
    angles = torch.rand(64, d // 2, generator=g, device=DEVICE) * 6.3
    positions = torch.randint(0, 64, (tokens,), generator=g, device=DEVICE)
    slots = torch.randperm(4 * 16, generator=g, device=DEVICE)[:tokens]
    if tokens > 2:
        slots[2] = -1
    scales = (0.5, 2.0) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)

    def operands():  # a fresh cache for each path
        cache = torch.zeros(2, 4, 16, kv_heads, d, device=DEVICE).to(cache_dtype)
        return fragment_kernel.RotaryWrite(
            angles.cos().half(), angles.sin().half(), positions, cache, slots, heads, kv_heads,
            *scales,
        )  # fmt: skip

    def write(qkv, r):
        return pointwise.qkv_rotary_write(
            qkv, r.cos, r.sin, r.positions, r.kv_cache, r.slot_mapping, r.num_heads,
            r.num_kv_heads, r.k_scale, r.v_scale,
        )  # fmt: skip

    return layer, group, x, operands, write


@pytest.mark.parametrize(
    "tokens, bias, cache_dtype",
    [(1, False, torch.float16), (11, True, torch.float16), (27, False, torch.float16),
     (40, True, torch.float16), (3, False, torch.float8_e4m3fn)],
)  # fmt: skip
def test_rotary_in_the_epilogue_gives_the_unfused_bits(tokens, bias, cache_dtype):
    """A q/k/v weight with each head's rows interleaved and the rotary + cache write in the
    kernel's epilogue (one mma, two, launches of 16; 40 tokens: the dequantized layer and
    cuBLAS, then the unfused write) = the plain layout's Int4Gemm, then
    `pointwise.qkv_rotary_write`, bit for bit: q and every cache byte (padding left alone)."""
    (qweight, scales, zeros, b), group, x, operands, write = rotary_case(tokens, bias, cache_dtype)
    plain = fragment_kernel.fragment_pack(qweight, scales, zeros, group)

    def il(t):
        return fragment_kernel.interleave_rotary(t, 32)

    mixed = fragment_kernel.fragment_pack(il(qweight), il(scales), il(zeros), group)
    want_r, got_r = operands(), operands()
    want = write(fragment_kernel.fragment_gemm(x, plain, b), want_r)
    got = fragment_kernel.fragment_gemm_rotary(x, mixed, got_r, None if b is None else il(b))
    assert got.shape == (tokens, 128)
    assert torch.equal(got, want)
    assert torch.equal(got_r.kv_cache.view(torch.uint8), want_r.kv_cache.view(torch.uint8))
    assert got_r.kv_cache.view(torch.uint8).count_nonzero() > 0
    # the interleaving: tile j of a head holds dims 8j..8j+7 then 16+8j..16+8j+7
    rows = il(torch.arange(128))
    assert rows[:16].tolist() == [*range(8), *range(16, 24)]
    assert rows[32:48].tolist() == [*range(32, 40), *range(48, 56)]
    assert torch.equal(fragment_kernel.deinterleave_rotary(rows[None], 32), torch.arange(128)[None])


def test_rotary_epilogue_refuses_a_layer_that_is_not_qkv():
    (qweight, scales, zeros, _), group, x, operands, _ = rotary_case(1, False, torch.float16)
    fw = fragment_kernel.fragment_pack(qweight[:224], scales[:224], zeros[:224], group)
    with pytest.raises(ValueError, match="rotary epilogue needs q/k/v rows"):
        fragment_kernel.int4_gemm_fragment(x, fw, rotary=operands())


def test_fragment_matmul_takes_x_in_another_dtype():
    """x in fp32 against fp16 weights: multiplied in fp32, y in fp32 (the plugin's contract)."""
    qweight, scales, zeros, b = make_layer(32, 256, 128, torch.float16, True, 0)
    fw = fragment_kernel.fragment_pack(qweight, scales, zeros, 128)
    x = torch.randn(3, 256, device=DEVICE)[:, ::1]
    got = fragment_kernel.fragment_matmul(x.t().contiguous().t(), fw, b)  # non-contiguous x
    want = x.double() @ dequantize(qweight, scales, zeros, 128).double().T + b.double()
    assert got.dtype == torch.float32
    assert float((got.double() - want).norm() / want.norm()) < 1e-5


def test_fragment_kernel_matches_reference_in_bf16():
    # bf16 output: one rounding to 8 bits of mantissa (the tests' bf16 bound elsewhere: 1e-2)
    assert run(3, 32, 256, 64, True, dtype=torch.bfloat16) < 1e-2


def matmul_error(tokens, n, k, group, bias, seed=0, dtype=torch.float16):
    """`fragment_matmul` (the layer dequantized from the fragment layout, then a matmul)
    against the fp64 product of the reference's weight; the dequantized weight itself must be
    the reference's rounded once to ``dtype``."""
    qweight, scales, zeros, b = make_layer(n, k, group, dtype, bias, seed)
    fw = fragment_kernel.fragment_pack(qweight, scales, zeros, group)
    w = dequantize(qweight, scales, zeros, group)
    got_w = fragment_kernel.fragment_dequantize(fw)
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # Triton's CPU interpreter truncates fp32 to bf16 (the GPU rounds to nearest): one ulp
        torch.testing.assert_close(got_w, w.to(dtype), rtol=2**-7, atol=0)
    else:
        assert torch.equal(got_w, w.to(dtype))
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    x = torch.randn(2, tokens // 2, k, generator=g, device=DEVICE).to(dtype)
    got = fragment_kernel.fragment_matmul(x, fw, b)
    assert got.shape == (2, tokens // 2, n) and got.dtype == dtype
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    return float((got.double() - exact).norm() / exact.norm())


# Several tiles and blocks, a last program with blocks past K (K = 640: 10 blocks, 8 a
# program), groups of 64, 128 and 256, fp16 and bf16.
@pytest.mark.parametrize(
    "tokens, n, k, group, bias, dtype",
    [
        (20, 48, 640, 128, True, torch.float16),
        (34, 32, 512, 64, False, torch.float16),
        (18, 16, 1024, 256, True, torch.bfloat16),
    ],
)
def test_fragment_matmul_matches_reference(tokens, n, k, group, bias, dtype):
    # fp16 weights: the operand rounded once (as the plugin-layout dot kernel's); bf16: 8 bits
    assert matmul_error(tokens, n, k, group, bias, dtype=dtype) < (
        1e-3 if dtype == torch.float16 else 1e-2
    )


def test_fragment_dequantize_checks_out():
    qweight, scales, zeros, _ = make_layer(16, 256, 128, torch.float16, False, 0)
    fw = fragment_kernel.fragment_pack(qweight, scales, zeros, 128)
    with pytest.raises(ValueError, match=r"contiguous torch.float16 or torch.float32 \[16, 256\]"):
        fragment_kernel.fragment_dequantize(
            fw, out=torch.empty(256, 16, dtype=torch.float16, device=DEVICE).T
        )


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(4096, 4096), (11008, 4096), (4096, 11008), (2560, 2048)])
@pytest.mark.parametrize("tokens", [1, 2, 7, 8, 9, 16, 27, 32])
def test_fragment_kernel_on_gpu(n, k, tokens):
    assert run(tokens, n, k, 128, bias=tokens % 2 == 1) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(4096, 4096), (11008, 4096), (4096, 11008)])
@pytest.mark.parametrize("tokens", [1, 5, 8, 16])
def test_fragment_kernel_on_gpu_in_bf16(n, k, tokens):
    assert run(tokens, n, k, 128, bias=True, dtype=torch.bfloat16) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n, k, group", [(4096, 4096, 128), (11008, 4096, 64), (4096, 11008, 128), (2560, 2048, 256)]
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fragment_matmul_on_gpu(n, k, group, dtype):
    assert matmul_error(256, n, k, group, bias=True, dtype=dtype) < (
        1e-3 if dtype == torch.float16 else 1e-2
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "plan",
    [
        fragment_kernel.FragmentPlan(2, 4),
        fragment_kernel.FragmentPlan(1, 16),
        fragment_kernel.FragmentPlan(1, 4, evict_first=True),
    ],
)
def test_fragment_kernel_plans_on_gpu(plan):
    assert run(4, 4096, 4096, 128, bias=True, plan=plan) < 1e-3
    assert run(1, 112, 1408, 64, bias=False, plan=plan) < 1e-3


COMPILE_FOR_SM90 = r'''
from trtc.plugins.int4_gemm import fragment_kernel as fk


def compile_for_sm90(tokens, n, k, bf16, swiglu=False, rotary=None):
    """The kernel as the executor launches it for this call, compiled for sm_90: (plan, asm).
    ``rotary``: (q heads, kv heads, head_dim) of a q/k/v projection with its rotary epilogue."""
    plan = fk.fragment_plan(tokens, n, k, 128)
    chunk = -(-(k // 128) // plan.warps_k)
    text, constraints = fk._asm_text(chunk, 8, tokens > 8, True, False, bf16)
    heads, kv_heads, head_dim = rotary or (1, 1, 16)
    consts = dict(TILES=plan.tiles, WARPS_K=plan.warps_k, CHUNK=chunk, SPG=8, TWO=tokens > 8,
                  BF16=bf16, HAS_BIAS=False, ASM=True, ASM_TEXT=text, CONSTRAINTS=constraints,
                  PDL=True, SWIGLU=swiglu, ROTARY=rotary is not None, HEADS=heads,
                  KV_HEADS=kv_heads, HALF=head_dim // 2, FP8=False)
    half = "*bf16" if bf16 else "*fp16"
    sig = {"x_ptr": half, "words_ptr": "*i32", "records_ptr": half, "bias_ptr": half,
           "y_ptr": half, "T": "i32", "N": "i32", "K": "i32", "G": "i32", "cos_ptr": half,
           "sin_ptr": half, "pos_ptr": "*i64", "slot_ptr": "*i64", "cache_ptr": half,
           "cache_kv_stride": "i64", "k_scale": "fp32", "v_scale": "fp32"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 6, 7)}
    return plan, compile_sm90(fk._int4_fragment, sig, consts, attrs,
                              num_warps=plan.tiles * plan.warps_k)
'''

LAYOUT_PROBE = (
    COMPILE_FOR_SM90
    + r"""
for tokens, n, k, bf16 in [(1, 4096, 4096, False), (16, 4096, 4096, False),
                          (2, 4096, 11008, False), (9, 4096, 4096, True)]:
    plan, asm = compile_for_sm90(tokens, n, k, bf16)
    ttgir = asm["ttgir"]
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*>)$", ttgir, re.M))
    for line in ttgir.splitlines():
        if "tt.elementwise_inline_asm" in line:
            layout = re.search(r"-> tensor<\d+xf32, (#\w+)>", line).group(1)
            print(tokens, n, k, plan.tiles * plan.warps_k, aliases[layout])
"""
)

SPILL_PROBE = (
    COMPILE_FOR_SM90
    + r"""
# the longest rows the layout takes (LANE_STEPS a lane at MAX_WARPS_K warps: K = 12288 at
# group 128), one and two mma's, both dtypes
longest = fk.LANE_STEPS * fk.MAX_WARPS_K * fk.STEP_COLS
assert fk.fragment_supports(4096, longest, 128) is None
for tokens, n, k, bf16, swiglu, rotary in [
        (1, 4096, longest, False, False, None), (16, 4096, longest, False, False, None),
        (8, 4096, longest, True, False, None), (16, 11008, 4096, True, False, None),
        (1, 11264, 2048, False, True, None), (16, 22016, 4096, False, True, None),
        (1, 2560, 2048, False, False, (32, 4, 64)), (16, 12288, 4096, True, False, (32, 32, 128))]:
    plan, asm = compile_for_sm90(tokens, n, k, bf16, swiglu, rotary)
    registers, stores, loads = ptxas_report(asm["ptx"])
    print(tokens, k, plan.warps_k, registers, f"{stores}/{loads}")
"""
)


def test_fragment_asm_sees_one_element_per_thread_in_order():
    """The kernel's one assumption about Triton (module docstring): the inline asm's operands
    have element i in lane i % 32 of warp i // 32. Compiled for sm_90 on this machine."""
    lines = run_probe(LAYOUT_PROBE)
    assert len(lines) == 4, lines
    for line in lines:
        warps = line.split()[3]
        assert line.endswith(
            f"#ttg.blocked<{{sizePerThread = [1], threadsPerWarp = [32], "
            f"warpsPerCTA = [{warps}], order = [0]}}>"
        ), line


def test_fragment_kernel_holds_a_lanes_share_in_registers():
    """`fragment_supports`' row-length limit: the longest rows the layout takes compile for
    sm_90 without spills (ptxas -v); and the SwiGLU and rotary epilogues (gate/up and q/k/v
    of the 1.1B and 7B models, one and two mma's)."""
    lines = run_probe(SPILL_PROBE)
    assert len(lines) == 8, lines
    for line in lines:
        assert line.split()[4:] == ["0/0"], line  # spill stores / loads, bytes


ROTARY_READS_PROBE = (
    COMPILE_FOR_SM90
    + r"""
# The q/k/v projection with its rotary epilogue, one and two mma's: where its global loads sit
# against the PDL wait (the asm's griddepcontrol.wait), by the width of what they load.
for tokens in (1, 16):
    plan, asm = compile_for_sm90(tokens, 2560, 2048, False, False, (32, 4, 64))
    ptx = asm["ptx"]
    wait = ptx.index("griddepcontrol.wait;")
    for width in ("b16", "b64"):
        loads = [m.start() for m in re.finditer(rf"ld\.global(\.\w+)*\.{width} ", ptx)]
        print(tokens, width, len(loads), sum(at > wait for at in loads))
"""
)


def test_rotary_reads_precede_the_wait():
    """The rotary epilogue's positions and slots (64-bit) and cos/sin (16-bit) are loaded
    before the asm's PDL wait, off the chain that follows it (docs/gpu-kernels.md, "The rotary's
    reads before the wait"): none of those loads comes after the wait in the PTX. (The weights
    are 32-bit vector loads before it, x after it.)"""
    lines = run_probe(ROTARY_READS_PROBE)
    assert len(lines) == 4, lines
    for line in lines:
        tokens, width, loads, after = line.split()
        # a position and a slot (b64), a cos and a sin (b16) for each token a lane's
        # accumulators hold: two at one mma, four at two
        assert int(loads) == 2 * (2 if tokens == "1" else 4), line
        assert after == "0", line


def emulate(tokens, n, k, group, warps_k, evict_first=False, seed=0, dtype=torch.float16):
    """The kernel's asm for every warp of every program, in `ptx_emulator` (numpy), with the
    operands `_int4_fragment` gives it, the warps' sums added as `_store_acc` adds them;
    returns the relative error against the fp64 product."""
    import numpy as np

    from harness.ptx_emulator import LANES, WarpEmulator

    qweight, scales, zeros, _ = make_layer(n, k, group, dtype, False, seed, device="cpu")
    fw = fragment_kernel.fragment_pack(qweight, scales, zeros, group)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    parts = [
        t.contiguous().view(torch.uint8).numpy().reshape(-1) for t in (fw.words, fw.records, x)
    ]
    bases = [0, parts[0].size, parts[0].size + parts[1].size]  # all multiples of 16
    memory = np.concatenate(parts)
    spg, groups = group // 16, k // group
    chunk = -(-groups // warps_k)
    two = tokens > fragment_kernel.ONE_MMA_TOKENS
    asm, constraints = fragment_kernel._asm_text(
        chunk, spg, two, True, evict_first, dtype == torch.bfloat16
    )
    lane = np.arange(LANES)
    g, c = lane // 4, lane % 4
    y = np.zeros((tokens, n))
    for tile in range(n // 16):
        total = 0
        for kc in range(warps_k):
            step0 = kc * chunk * spg
            nvalid = np.full(LANES, min(max(groups - kc * chunk, 0), chunk))
            col0 = np.where(nvalid > 0, step0 * 16 + 16 * c, 0)
            operands = [
                bases[0] + (((tile * (k // 64) + step0 // 4) * 32 + lane) * 4) * 4,
                bases[1] + (((tile * groups + kc * chunk) * 8 + g) * 4) * 2,
                bases[2] + (np.minimum(g, tokens - 1) * k + col0) * 2,
            ]
            if two:
                operands.append(bases[2] + (np.minimum(g + 8, tokens - 1) * k + col0) * 2)
            out = WarpEmulator(memory).run(asm, constraints, operands + [nvalid])
            total = total + np.stack(out)  # [accumulators, lanes]
        for m, acc in enumerate(total):
            rows = tile * 16 + g + 8 * (m % 4 >= 2)
            toks = 2 * c + (m & 1) + 8 * (m >= 4)
            keep = toks < tokens
            y[toks[keep], rows[keep]] = acc[keep]
    exact = x.double() @ dequantize(qweight, scales, zeros, group).double().T
    return float((torch.from_numpy(y) - exact).norm() / exact.norm())


# The asm itself, without a GPU: group 64 (4 steps a group, 2 groups a warp), the second mma's
# tokens, warps with no groups, evict-first loads; bf16. The weight is exact in either dtype
# and the sums are fp32, so the emulated warp is as close as the fp64 product's rounding.
@pytest.mark.parametrize(
    "tokens, n, k, group, warps_k, evict_first, dtype",
    [
        (3, 32, 256, 64, 2, False, torch.float16),
        (11, 16, 512, 128, 4, False, torch.float16),
        (1, 16, 256, 128, 4, True, torch.float16),
        (3, 32, 256, 64, 2, False, torch.bfloat16),
        (11, 16, 512, 128, 4, False, torch.bfloat16),
    ],
)
def test_fragment_asm_in_an_emulated_warp(tokens, n, k, group, warps_k, evict_first, dtype):
    assert emulate(tokens, n, k, group, warps_k, evict_first, dtype=dtype) < 1e-6


def test_fragment_kernel_refuses_misaligned_x():
    qweight, scales, zeros, _ = make_layer(16, 256, 128, torch.float16, False, 0, device="cpu")
    fw = fragment_kernel.fragment_pack(qweight, scales, zeros, 128)
    x = torch.randn(2 * 256 + 1).half()[1:].view(2, 256)  # 2 bytes off
    with pytest.raises(ValueError, match="16-byte aligned"):
        fragment_kernel.int4_gemm_fragment(x, fw)


def test_fragment_rewrite_takes_each_weight_once():
    """`fusions/int4_fragment.py`'s rewrite: fp16 and bf16 weights (fp32 ones stay on the plugin's
    kernels), a weight read by two nodes is packed once, a node with another weight gets its
    own."""
    from trtc.runtime.executors.fusions import fuse
    from trtc.runtime.executors.fusions.int4_fragment import INT4_GEMM_FRAGMENT
    from trtc.runtime.executors.graph import GraphNode

    constants = {}
    for name, dtype in (("a", torch.float16), ("b", torch.float32), ("c", torch.bfloat16)):
        qweight, scales, zeros, _ = make_layer(32, 256, 128, dtype, False, 0, device="cpu")
        constants.update({f"{name}.q": qweight, f"{name}.s": scales, f"{name}.z": zeros})
    attrs = {"group_size": 128, "in_features": 256, "out_features": 32}
    nodes = [
        GraphNode(("trtc", "Int4Gemm"), ["x", f"{w}.q", f"{w}.s", f"{w}.z"], [f"y{i}"], attrs)
        for i, w in enumerate("aabc")
    ]
    # a fourth weight whose scales another node also reads: its stored layout must stay
    qweight, scales, zeros, _ = make_layer(32, 256, 128, torch.float16, False, 1, device="cpu")
    constants.update({"d.q": qweight, "d.s": scales, "d.z": zeros})
    nodes.append(GraphNode(("trtc", "Int4Gemm"), ["x", "d.q", "d.s", "d.z", "bias"], ["y4"], attrs))
    nodes.append(GraphNode(("", "Identity"), ["d.s"], ["y5"], {}))
    # a fifth weight sharing c's zeros (another key): c.z must outlive the first packing
    qweight, _, _, _ = make_layer(32, 256, 128, torch.bfloat16, False, 2, device="cpu")
    constants["e.q"] = qweight
    nodes.append(GraphNode(("trtc", "Int4Gemm"), ["x", "e.q", "c.s", "c.z"], ["y6"], attrs))
    fused, counts = fuse(nodes, constants, {f"y{i}" for i in range(7)})
    assert counts["int4_fragment"] == 5
    assert [n.op == INT4_GEMM_FRAGMENT for n in fused] == [
        True,
        True,
        False,
        True,
        True,
        False,
        True,
    ]
    assert fused[0].inputs[2:] == fused[1].inputs[2:] != fused[3].inputs[2:]
    assert fused[0].inputs[:2] == ["x", ""] and fused[4].inputs[:2] == ["x", "bias"]
    assert sum(".fragment" in name for name in constants) == 8
    # the stored layout of the taken weights is gone, except what another node reads
    assert not {"a.q", "a.s", "a.z", "c.q", "c.s", "c.z", "d.q", "d.z", "e.q"} & set(constants)
    assert {"b.q", "b.s", "b.z", "d.s"} <= set(constants)


def test_fragment_memory_estimate():
    """What the executor reserves before loading (`fusions/int4_fragment.py`
    `int4_fragment_bytes`): the records' extra byte a row and group, plus the largest
    projection's transient fp16 weight for prefill (the 1.1B geometry: gate/up, 11264 x 2048)."""
    from trtc.artifact import Manifest, ModelGeometry, QuantizationRecord
    from trtc.runtime.executors.fusions.int4_fragment import int4_fragment_bytes

    n_k_g = 100_000_000  # N K / g summed over the Linears
    quant = QuantizationRecord(
        method="rtn", bits=4, group_size=128, linear_weight_bytes_quantized=n_k_g * 64 + 3 * n_k_g
    )
    model = ModelGeometry.model_construct(
        hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=64, intermediate_size=5632
    )
    manifest = Manifest.model_construct(precision="fp16", quantization=quant, model=model)
    assert int4_fragment_bytes(manifest) == pytest.approx(n_k_g + 2 * 11264 * 2048, abs=2)
    assert int4_fragment_bytes(manifest.model_copy(update={"precision": "fp32"})) == 0
    unquantized = QuantizationRecord(method="none")
    assert int4_fragment_bytes(manifest.model_copy(update={"quantization": unquantized})) == 0
