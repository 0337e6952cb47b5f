"""`trtc::Int4Gemm` for decode steps of 1..16 tokens on the matrix units, from registers: the
"fragment" kernel. Semantics are the reference's (`reference.py`); the weight is read in a
layout made for it at load time (`fragment_pack`), not the plugin's ``[N, K/2]`` bytes. The
CUDA executor holds that layout instead of the plugin's
(runtime/executors/fusions/int4_fragment.py), so calls of more than 16 tokens read it too:
`fragment_matmul` dequantizes the layer (`fragment_dequantize`) and multiplies with cuBLAS.

Why another kernel: the weights-first rows kernel (`triton_kernels._int4_rows`) multiplies in
CUDA cores, about one instruction per weight and token, so it only wins at one or two tokens; the
split kernel uses the matrix units but Triton stages its weights through shared memory and
issues their loads after the wait for the previous kernel. Here each warp multiplies a 16-row
tile with ``mma.sync.m16n8k16`` straight from registers, which costs nearly the same at 1 and
at 8 tokens (16 with a second mma a step), and all of a program's weights are requested before
the wait (as the rows kernel does). Measurements: docs/gpu-kernels.md, "The fragment kernel".

The fragment layout. ``mma.sync.m16n8k16`` (fp16 or bf16 inputs, fp32 accumulators) wants
lane ``l = 4 g + c`` of a warp to hold, of a 16 x 16 weight tile, rows ``g`` and ``g + 8`` at
four of the 16 columns (its A fragment: 8 weights, one 32-bit word of nibbles), and of x the
same four columns for token ``g`` (its B fragment). Which four does not matter as long as A and
B agree (the mma sums over them), so they are chosen to make x's loads wide: in each block of 64
columns (four steps) lane c takes columns ``16 c .. 16 c + 15``, four a step, so its B fragments
of four steps are 32 contiguous bytes of x. `fragment_pack` stores, for each 16-row tile ``r`` and
64-column block ``b``, the 32 lanes' words of steps ``u = 0..3``, nibble ``m`` (bits ``4m ..
4m + 3``) of a lane's word holding::

    row = 16 r + g + 8 * (m & 1),   col = 64 b + 16 c + 4 u + 2 * ((m >> 1) & 1) + (m >> 2)

so that two LOP3s of the word (nibbles 0/4 and 1/5) and two of the word shifted right by 8 (2/6
and 3/7) give the four f16x2 registers of the A operand in order. Words are stored ``[N/16,
K/64, 32 lanes, 4 steps]``: a lane loads four steps in one 16-byte load, a warp 512 contiguous
bytes. Per (tile, group, g) an 8-byte record in x's dtype: ``-(1024 + z)`` of row g, ``-(64 +
z)`` of row g + 8 (the dequantization's offsets, see below; bf16: ``-(128 + z)`` both) and the
two rows' scales. The layout holds the same bytes as the plugin's packed weight, and records of
4 bytes per row and group instead of 3 for scales and zeros.

Dequantization (inline PTX, as the other kernels): OR-ing a nibble into the mantissa of 1024
gives ``1024 + q`` exactly; for the high nibble of a byte pair it is ``1024 + 16 q``, taken
times 1/16. Adding the record's offset gives ``q - z`` exactly in fp16. bf16 (x and scales in
bf16, the records too) has 7 mantissa bits: each nibble is shifted down first and OR-ed into
128, and the records hold ``-(128 + z)`` for both rows. The mma multiplies by x
and sums in fp32; each group's sums are multiplied by its scale in fp32 (the weight is never
rounded). A program owns ``TILES`` 16-row tiles; ``WARPS_K`` warps share a tile's columns,
``CHUNK`` groups each, and their sums are added at the end (the tile's last warps may have
nothing to do: their groups past K are predicated off).

Only the elementwise inline asm puts tensors in registers here, so the kernel depends on each
``[32 * num_warps]`` tensor having element ``i`` in lane ``i % 32`` of warp ``i // 32`` (Triton's
default layout for such a tensor; a test compiles the kernel for sm_90 and checks it) and on
the asm being executed by the whole warp at once (mma.sync is warp-wide). Triton's CPU
interpreter runs a portable version of the same loads and arithmetic (``ASM=False``); the tests
also run the PTX itself in a numpy emulator of one warp (tests/harness/ptx_emulator.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from trtc.gpu_profiles import has_feature
from trtc.plugins.int4_gemm.reference import unpack_int4
from trtc.plugins.int4_gemm.triton_kernels import _interpreting
from trtc.plugins.kernels import pdl
from trtc.plugins.kernels.pointwise import qkv_rotary_write, rotate_halves
from trtc.plugins.paged_attention.triton_kernels import to_cache

TILE_ROWS = 16  # an mma's M
STEP_COLS = 16  # an mma's K
MAX_TOKENS = 16  # two mma's of N = 8 a step
GROUP_SIZES = (64, 128, 256)


@dataclass(frozen=True)
class FragmentWeight:
    """One Int4Gemm weight in the fragment layout (module docstring): ``words`` int32 ``[N/16,
    K/64, 32, 4]``, ``records`` ``[N/16, G, 8, 4]`` in the activations' dtype (fp16 or bf16);
    plus the layer's shape."""

    words: torch.Tensor
    records: torch.Tensor
    out_features: int
    in_features: int
    group_size: int

    @property
    def groups(self) -> int:
        return self.records.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.records.dtype

    @property
    def nbytes(self) -> int:
        return self.words.numel() * 4 + self.records.numel() * 2


def device_supports(device: torch.device) -> bool:
    """mma.sync.m16n8k16 on fp16 and bf16, and the cache-policy loads: sm_80 and later (and
    Triton's CPU interpreter, which runs the portable version)."""
    if device.type != "cuda":
        return _interpreting()
    return has_feature(device, "mma_fragments")


def fragment_supports(out_features: int, in_features: int, group_size: int) -> str | None:
    """None if the fragment kernel takes this layer, else why not."""
    if out_features % TILE_ROWS:
        return f"out_features {out_features} is not a multiple of {TILE_ROWS}"
    if group_size not in GROUP_SIZES:
        return f"group size {group_size} is not one of {', '.join(map(str, GROUP_SIZES))}"
    if in_features % group_size:  # the group sizes are multiples of 64
        return f"in_features {in_features} is not a multiple of the group size {group_size}"
    steps = lane_steps(in_features, group_size, MAX_WARPS_K)
    if steps > LANE_STEPS:
        return (
            f"in_features {in_features} is too long: a lane would hold {steps} steps of a "
            f"tile's weight at {MAX_WARPS_K} warps a tile (at most {LANE_STEPS} fit in its "
            f"registers)"
        )
    return None


# A lane holds its whole share of a tile's weight in registers, one 32-bit word a 16-column
# step: at most 96 steps, and at most 8 warps share a tile. ptxas for sm_90 fits 96 steps at 8
# warps, one or two mma's, without spilling (a test checks it); 16 warps (512 threads a program)
# leave a lane 128 registers, too few (docs/gpu-kernels.md, "One layout"). Longer rows (K >
# 12288 at group 128) stay on the plugin's layout and kernels.
LANE_STEPS = 96
MAX_WARPS_K = 8


def lane_steps(in_features: int, group_size: int, warps_k: int) -> int:
    """16-column steps of a tile's weight one lane holds with ``warps_k`` warps a tile (whole
    groups a warp)."""
    groups = in_features // group_size
    return -(-groups // warps_k) * (group_size // STEP_COLS)


def fragment_pack(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> FragmentWeight:
    """The plugin's ``qweight [N, K/2]``, ``scales [N, G]`` (fp16 or bf16: the activations'
    dtype), ``zeros [N, G]`` in the fragment layout (on their device; torch ops, a load-time
    step)."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    why = fragment_supports(n, k, group_size)
    if why:
        raise ValueError(f"Int4Gemm fragment layout: {why}")
    if scales.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"Int4Gemm fragment layout: scales must be fp16 or bf16 (the "
            f"activations' dtype), got {scales.dtype}"
        )
    tiles, blocks = n // TILE_ROWS, k // 64
    words = torch.empty((tiles, blocks, 32, 4), dtype=torch.int32, device=qweight.device)
    # 2**24 weights at a time: the unpacked nibbles of a whole layer would take 8x its bytes.
    chunk = max(1, (1 << 24) // (TILE_ROWS * k))
    for r0 in range(0, tiles, chunk):
        r1 = min(tiles, r0 + chunk)
        q = unpack_int4(qweight[r0 * TILE_ROWS : r1 * TILE_ROWS]).to(torch.int32)  # [rows, K]
        # row = 16 r + 8 hb + g, col = 64 b + 16 c + 4 u + 2 kh + kl; nibble m = hb + 2 kh + 4 kl
        q = q.view(r1 - r0, 2, 8, blocks, 4, 4, 2, 2).permute(0, 3, 2, 4, 5, 7, 6, 1)
        q = q.reshape(r1 - r0, blocks, 8, 4, 4, 8)  # r b g c u m
        word = q[..., 0]
        for m in range(1, 8):  # disjoint bits: int32 wraps into the sign bit
            word = word | (q[..., m] << (4 * m))
        words[r0:r1] = word.view(r1 - r0, blocks, 32, 4)  # [r, b, lane, u]
    z = zeros.to(torch.float32).view(tiles, 2, 8, -1)  # [r, hb, g, G]
    s = scales.to(torch.float32).view(tiles, 2, 8, -1)
    # The dequantization's offsets (exact in either dtype), then both rows' scales.
    lo, hi = (128.0, 128.0) if scales.dtype == torch.bfloat16 else (1024.0, 64.0)
    records = torch.stack((-(lo + z[:, 0]), -(hi + z[:, 1]), s[:, 0], s[:, 1]), dim=-1)
    records = records.permute(0, 2, 1, 3).to(scales.dtype).contiguous()  # [r, G, g, 4]
    return FragmentWeight(words, records, n, k, group_size)


# --- the PTX of one warp's share ------------------------------------------------------------


def _warp_asm(
    chunk: int,
    steps_per_group: int,
    two_mma: bool,
    pdl_on: bool,
    evict_first: bool = False,
    bf16: bool = False,
) -> str:
    """The inline PTX of one lane: load its words and records (``chunk`` groups of
    ``steps_per_group`` 16-column steps; group ``i`` only if ``i < nvalid``), let the next kernel
    launch and wait for the previous one (PDL), then per group: x's B fragments (two 16-byte
    loads per 4 steps, the next group's issued before this group's products), each word
    dequantized into the A fragment, one mma per step and 8 tokens into the group's sums,
    scaled into the accumulators at the group's end. Operands: outputs ``$0..$3`` (``$0..$7``
    with ``two_mma``) the accumulators; then the words' address, the records' address, x's
    address (and the second 8 tokens'), nvalid. ``evict_first``: the words' loads carry L2's
    evict-first policy (plans leave it off: it made no difference, docs/gpu-kernels.md, "The
    fragment kernel"). ``bf16``: x, the records and the mma in bf16 (module docstring)."""
    outs = 8 if two_mma else 4
    a_w, a_r, a_x = outs, outs + 1, outs + 2
    a_x2 = outs + 3
    a_n = outs + (4 if two_mma else 3)
    spg = steps_per_group
    steps = chunk * spg
    xs = 2 if two_mma else 1
    ab = "bf16" if bf16 else "f16"
    lines = [
        "{",
        f".reg .pred p<{chunk}>;",
        f".reg .b32 w<{steps}>;",
        f".reg .b32 rz<{chunk}>, rs<{chunk}>;",
        f".reg .b32 x<{steps * 2 * xs}>;",
        ".reg .b64 xg, xh;",
        ".reg .b32 t, a0, a1, a2, a3, olo, ohi, c16, sb;",
        ".reg .b16 sl, sh;",
        ".reg .f32 d<8>, acc<8>, fl, fh, zero;",
        # fp16: 1/16 in both halves (the high nibbles); bf16: 1.0 (an fma adds the offset)
        f"mov.b32 c16, {'0x3F803F80' if bf16 else '0x2C002C00'};",
        "mov.f32 zero, 0f00000000;",
    ]
    for j in range(outs):
        lines.append(f"mov.f32 acc{j}, 0f00000000;")
    for i in range(chunk):
        lines.append(f"setp.gt.s32 p{i}, ${a_n}, {i};")
    # Every load of constant data before the wait: the words (16 bytes = 4 steps a load, the
    # next 4 steps 512 bytes on) and each group's record. Only the loads of groups past K are
    # predicated off: their record stays zero (scale 0: they add nothing), and everything else
    # runs on every lane (predicated mma.sync or loads make ptxas branch around them).
    for i in range(chunk):
        lines += [f"mov.b32 rz{i}, 0;", f"mov.b32 rs{i}, 0;"]
    hint, policy = "", ""
    if evict_first:
        lines += [".reg .b64 policy;", "createpolicy.fractional.L2::evict_first.b64 policy, 1.0;"]
        hint, policy = ".L2::cache_hint", ", policy"
    for s0 in range(0, steps, 4):
        lines.append(
            f"@p{s0 // spg} ld.global.nc.L1::no_allocate{hint}.v4.b32 "
            f"{{w{s0}, w{s0 + 1}, w{s0 + 2}, w{s0 + 3}}}, [${a_w}+{s0 // 4 * 512}]"
            f"{policy};"
        )
    for i in range(chunk):
        lines.append(f"@p{i} ld.global.nc.v2.b32 {{rz{i}, rs{i}}}, [${a_r}+{i * 64}];")
    if pdl_on:
        lines += ["griddepcontrol.launch_dependents;", "griddepcontrol.wait;"]

    def load_x(i):
        # x of group i; a group past K reads the warp's first group again (in bounds; its
        # record is zero).
        out = []
        for h, base in enumerate([f"${a_x}"] + ([f"${a_x2}"] if two_mma else [])):
            out += [f"add.s64 xg, {base}, {i * spg * 32};", f"selp.b64 xh, xg, {base}, p{i};"]
            for s0 in range(i * spg, (i + 1) * spg, 4):
                off = (s0 - i * spg) * 32
                r = (h * steps + s0) * 2
                out += [
                    f"ld.global.v4.b32 {{x{r}, x{r + 1}, x{r + 2}, x{r + 3}}}, [xh+{off}];",
                    f"ld.global.v4.b32 {{x{r + 4}, x{r + 5}, x{r + 6}, x{r + 7}}}, "
                    f"[xh+{off + 16}];",
                ]
        return out

    lines += load_x(0)
    for i in range(chunk):
        if i + 1 < chunk:
            lines += load_x(i + 1)
        lines += [f"prmt.b32 olo, rz{i}, 0, 0x1010;", f"prmt.b32 ohi, rz{i}, 0, 0x3232;"]
        for u in range(spg):
            s = i * spg + u
            first = u == 0
            if bf16:  # nibble m of the word: shifted down to bits 0-3 / 16-19 first
                for r, shift in enumerate((0, 4, 8, 12)):
                    src = f"w{s}"
                    if shift:
                        lines.append(f"shr.b32 t, w{s}, {shift};")
                        src = "t"
                    lines += [
                        f"lop3.b32 a{r}, {src}, 0x000F000F, 0x43004300, 0xEA;",
                        f"fma.rn.bf16x2 a{r}, a{r}, c16, {'ohi' if r % 2 else 'olo'};",
                    ]
            else:
                lines += [
                    f"lop3.b32 a0, w{s}, 0x000F000F, 0x64006400, 0xEA;",
                    f"lop3.b32 a1, w{s}, 0x00F000F0, 0x64006400, 0xEA;",
                    f"shr.b32 t, w{s}, 8;",
                    "lop3.b32 a2, t, 0x000F000F, 0x64006400, 0xEA;",
                    "lop3.b32 a3, t, 0x00F000F0, 0x64006400, 0xEA;",
                    "add.f16x2 a0, a0, olo;",
                    "fma.rn.f16x2 a1, a1, c16, ohi;",
                    "add.f16x2 a2, a2, olo;",
                    "fma.rn.f16x2 a3, a3, c16, ohi;",
                ]
            for h in range(xs):
                d = f"d{4 * h}, d{4 * h + 1}, d{4 * h + 2}, d{4 * h + 3}"
                acc_in = "zero, zero, zero, zero" if first else d
                r = (h * steps + s) * 2
                lines.append(
                    f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 "
                    f"{{{d}}}, {{a0, a1, a2, a3}}, {{x{r}, x{r + 1}}}, {{{acc_in}}};"
                )
        # d0, d1 (and d4, d5): row g; d2, d3 (d6, d7): row g + 8.
        if bf16:  # a bf16 is the upper half of an fp32
            lines += [
                f"shl.b32 sb, rs{i}, 16;",
                "mov.b32 fl, sb;",
                f"and.b32 sb, rs{i}, 0xFFFF0000;",
                "mov.b32 fh, sb;",
            ]
        else:
            lines += [f"mov.b32 {{sl, sh}}, rs{i};", "cvt.f32.f16 fl, sl;", "cvt.f32.f16 fh, sh;"]
        for j in range(outs):
            lines.append(f"fma.rn.f32 acc{j}, d{j}, {'fl' if j % 4 < 2 else 'fh'}, acc{j};")
    for j in range(outs):
        lines.append(f"mov.f32 ${j}, acc{j};")
    lines.append("}")
    return "\n".join(lines)


@triton.jit
def _portable_sums(
    words_ptr,
    records_ptr,
    x_ptr,
    tile_c,
    kc,
    g,
    c,
    nvalid,
    T,
    K,
    G,
    CHUNK: tl.constexpr,
    SPG: tl.constexpr,
    BF16: tl.constexpr,
    TWO: tl.constexpr,
):
    """What the asm leaves in a lane's accumulators, in portable Triton (Triton's CPU
    interpreter): accumulator ``m`` holds row ``g + 8 ((m % 4) // 2)`` and token ``2c + m % 2 +
    8 (m // 4)``, the mma's sum over a step's 16 columns written out from the four lanes (g,
    0..3) that hold them. Both rows (``hb``) and the lane's tokens (``tk``) are axes here."""
    R: tl.constexpr = g.shape[0]
    step0 = kc * (CHUNK * SPG)  # the warp's first 16-column step
    NT: tl.constexpr = 4 if TWO else 2  # tokens 2c + tk % 2 + 8 (tk // 2)
    cq = tl.arange(0, 4)  # the lanes c' of row g's columns
    khl = tl.arange(0, 4)  # (kh, kl) = (khl // 2, khl % 2)
    hb = tl.arange(0, 2)  # rows g + 8 hb
    tk = tl.arange(0, NT)
    shift = 4 * (hb[:, None] + 2 * (khl // 2)[None, :] + 4 * (khl % 2)[None, :])  # [hb, khl]
    tok = tl.minimum(2 * c[:, None] + (tk % 2 + 8 * (tk // 2))[None, :], T - 1)  # [R, tk]
    if BF16:
        magic = tl.full([2], 128.0, tl.float32)
    else:
        magic = tl.where(hb == 1, 64.0, 1024.0)
    sums = tl.zeros((R, NT, 2), dtype=tl.float32)  # [R, tk, hb]
    for gi in range(CHUNK):
        ok = gi < nvalid
        rec = records_ptr + ((tile_c.to(tl.int64) * G + kc * CHUNK + gi) * 8 + g) * 4
        rec_hb = rec[:, None] + hb[None, :]
        offset = tl.load(rec_hb, mask=ok[:, None], other=0.0).to(tl.float32) + magic[None, :]
        scale = tl.load(rec_hb + 2, mask=ok[:, None], other=0.0).to(tl.float32)  # [R, hb]
        dot = tl.zeros((R, NT, 2), dtype=tl.float32)
        for u in range(SPG):
            s = step0 + gi * SPG + u  # the 16-column step
            blk = s // 4
            word = tl.load(
                words_ptr
                + (((tile_c.to(tl.int64) * (K // 64) + blk) * 32 + 4 * g) * 4 + s % 4)[:, None]
                + (cq * 4)[None, :],
                mask=ok[:, None],
                other=0,
            )  # [R, c']
            q = (word[:, :, None, None] >> shift[None, None, :, :]) & 0xF
            w = q.to(tl.float32) + offset[:, None, :, None]  # q - z: [R, c', hb, khl]
            col = (
                (blk * 64 + 4 * (s % 4))[:, None, None]
                + 16 * cq[None, :, None]
                + 2 * (khl // 2)[None, None, :]
                + (khl % 2)[None, None, :]
            )  # [R, c', khl]
            xv = tl.load(
                x_ptr + tok[:, :, None, None].to(tl.int64) * K + col[:, None, :, :],
                mask=ok[:, None, None, None],
                other=0.0,
            ).to(tl.float32)  # [R, tk, c', khl]
            prod = w[:, None, :, :, :] * xv[:, :, :, None, :]  # [R, tk, c', hb, khl]
            dot += tl.sum(tl.sum(prod, axis=4), axis=2)
        sums += dot * scale[:, None, :]
    row_g, row_g8 = tl.split(sums)  # [R, tk] each
    if TWO:
        g_even, g_odd = tl.split(tl.reshape(row_g, (R, 2, 2)))  # [R, mma] each
        g8_even, g8_odd = tl.split(tl.reshape(row_g8, (R, 2, 2)))
        a0, a4 = tl.split(g_even)
        a1, a5 = tl.split(g_odd)
        a2, a6 = tl.split(g8_even)
        a3, a7 = tl.split(g8_odd)
        return a0, a1, a2, a3, a4, a5, a6, a7
    else:
        a0, a1 = tl.split(row_g)
        a2, a3 = tl.split(row_g8)
        return a0, a1, a2, a3


@triton.jit(do_not_specialize=["T"])
def _int4_fragment(
    x_ptr,
    words_ptr,
    records_ptr,
    bias_ptr,
    y_ptr,
    T,
    N,
    K,
    G,
    TILES: tl.constexpr,
    WARPS_K: tl.constexpr,
    CHUNK: tl.constexpr,
    SPG: tl.constexpr,
    TWO: tl.constexpr,
    BF16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ASM: tl.constexpr,
    ASM_TEXT: tl.constexpr,
    CONSTRAINTS: tl.constexpr,
    PDL: tl.constexpr,
    SWIGLU: tl.constexpr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    cache_ptr,
    cache_kv_stride,
    k_scale,
    v_scale,
    ROTARY: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    FP8: tl.constexpr,
):
    """One program: ``TILES`` 16-row tiles, ``WARPS_K`` warps a tile (module docstring). Each
    tensor here has one element a thread: ``i = 32 * warp + lane``. ``SWIGLU``: the weight's
    rows are a gate/up projection's, interleaved (`interleave_gate_up`), and y is ``[T, N/2]``
    = SwiGLU of the product. ``ROTARY``: the weight is a merged q/k/v projection with each
    head's rows interleaved (`interleave_rotary`); y is the rotated q ``[T, HEADS * 2 HALF]``,
    and the rotated k and v go into their cache slots (`_rotary_epilogue`); the other rotary
    operands are unused otherwise."""
    THREADS: tl.constexpr = TILES * WARPS_K * 32
    PER: tl.constexpr = 8 if TWO else 4  # accumulators a lane
    i = tl.arange(0, THREADS)
    lane = i % 32
    warp = i // 32
    tile = tl.program_id(0) * TILES + warp // WARPS_K
    kc = warp % WARPS_K
    g = lane // 4
    c = lane % 4
    tiles = N // 16
    tile_ok = tile < tiles
    tile_c = tl.where(tile_ok, tile, 0)
    step0 = kc * (CHUNK * SPG)  # the warp's first 16-column step
    nvalid = tl.where(tile_ok, tl.minimum(tl.maximum(G - kc * CHUNK, 0), CHUNK), 0)
    # The epilogue's layout: lane (g, c)'s accumulator m holds row g + 8 (m % 4 >= 2) and token
    # 2c + (m & 1) (+ 8 for the second mma's, m >= 4) of each of the program's tiles.
    lane_t = tl.arange(0, 32)
    tile_t = (tl.program_id(0) * TILES + tl.arange(0, TILES))[:, None]
    row_t = tile_t * 16 + (lane_t // 4)[None, :]
    tok_t = 2 * (lane_t % 4)[None, :]
    if ROTARY:
        # The rotary's positions and cache slots (step inputs) and cos/sin rows (constants) are
        # read here, before the asm's PDL wait (`trtc.plugins.kernels.pdl`): after the sums
        # they were two dependent round trips on the chain that follows the wait. Accumulators
        # 0 and 1 (and 4 and 5) hold the first halves of their tokens' rotations.
        c0, s0, slot0 = _rotary_inputs(
            row_t, tok_t, T, N, cos_ptr, sin_ptr, pos_ptr, slot_ptr, HALF
        )
        c1, s1, slot1 = _rotary_inputs(
            row_t, tok_t + 1, T, N, cos_ptr, sin_ptr, pos_ptr, slot_ptr, HALF
        )
        if TWO:
            c4, s4, slot4 = _rotary_inputs(
                row_t, tok_t + 8, T, N, cos_ptr, sin_ptr, pos_ptr, slot_ptr, HALF
            )
            c5, s5, slot5 = _rotary_inputs(
                row_t, tok_t + 9, T, N, cos_ptr, sin_ptr, pos_ptr, slot_ptr, HALF
            )
    if ASM:
        # words [tiles, K/64, 32, 4] int32: this lane's 16 bytes of steps step0 .. step0 + 3
        wbase = words_ptr + ((tile_c.to(tl.int64) * (K // 64) + step0 // 4) * 32 + lane) * 4
        rbase = records_ptr + ((tile_c.to(tl.int64) * G + kc * CHUNK) * 8 + g) * 4
        # x as fp16/bf16 [T, K]: lane (g, c) reads token g's columns 16 c .. 16 c + 15 of each 64
        # (the B fragments of 4 steps); tokens past T read the last token (their sums are not
        # stored); a warp with nothing to do reads from x's start.
        tok = tl.minimum(g, T - 1)
        col0 = tl.where(nvalid > 0, step0 * 16 + 16 * c, 0)
        # The asm takes addresses as 64-bit integers (Triton broadcasts its operands together).
        wbase = wbase.to(tl.int64)
        rbase = rbase.to(tl.int64)
        xbase = (x_ptr + tok.to(tl.int64) * K + col0).to(tl.int64)
        if TWO:
            tok2 = tl.minimum(g + 8, T - 1)
            xbase2 = (x_ptr + tok2.to(tl.int64) * K + col0).to(tl.int64)
            acc = tl.inline_asm_elementwise(
                ASM_TEXT,
                CONSTRAINTS,
                [wbase, rbase, xbase, xbase2, nvalid],
                dtype=(tl.float32,) * PER,
                is_pure=False,
                pack=1,
            )
        else:
            acc = tl.inline_asm_elementwise(
                ASM_TEXT,
                CONSTRAINTS,
                [wbase, rbase, xbase, nvalid],
                dtype=(tl.float32,) * PER,
                is_pure=False,
                pack=1,
            )
    else:
        pdl.begin(PDL)
        acc = _portable_sums(
            words_ptr, records_ptr, x_ptr, tile_c, kc, g, c, nvalid, T, K, G, CHUNK, SPG, BF16, TWO
        )
    # The WARPS_K warps of a tile: their sums added (the layout above).
    for m in tl.static_range(PER):
        row = row_t + 8 * ((m % 4) // 2)
        tok = tok_t + m % 2 + 8 * (m // 4)
        if ROTARY:
            if m % 4 < 2:
                if m == 0:
                    c, s, slot = c0, s0, slot0
                elif m == 1:
                    c, s, slot = c1, s1, slot1
                elif m == 4:
                    c, s, slot = c4, s4, slot4
                else:
                    c, s, slot = c5, s5, slot5
                _rotary_epilogue(
                    acc[m],
                    acc[m + 2],
                    row,
                    tok,
                    T,
                    N,
                    bias_ptr,
                    y_ptr,
                    c,
                    s,
                    slot,
                    cache_ptr,
                    cache_kv_stride,
                    k_scale,
                    v_scale,
                    TILES,
                    WARPS_K,
                    HAS_BIAS,
                    HEADS,
                    KV_HEADS,
                    HALF,
                    FP8,
                )
        elif not SWIGLU:
            total = _tile_sums(acc[m], row, N, bias_ptr, TILES, WARPS_K, HAS_BIAS)
            ok = (row < N) & (tok < T)
            tl.store(y_ptr + tok.to(tl.int64) * N + row, total.to(y_ptr.dtype.element_ty), mask=ok)
        elif m % 4 < 2:
            # Rows g and g + 8 of a tile are gate and up of output 8 tile + g: the lane holds
            # both (accumulators m and m + 2). The arithmetic and roundings of the unfused
            # Int4Gemm (y rounded to its dtype) then SwiGLU (`pointwise._swiglu`), so the
            # fused node gives the same bits.
            ty = y_ptr.dtype.element_ty
            gate = _tile_sums(acc[m], row, N, bias_ptr, TILES, WARPS_K, HAS_BIAS).to(ty)
            up = _tile_sums(acc[m + 2], row + 8, N, bias_ptr, TILES, WARPS_K, HAS_BIAS).to(ty)
            g32 = gate.to(tl.float32)
            silu = (g32 / (1.0 + tl.exp(-g32))).to(ty)
            out_row = tile_t * 8 + (lane_t // 4)[None, :]
            ok = (out_row < N // 2) & (tok < T)
            tl.store(y_ptr + tok.to(tl.int64) * (N // 2) + out_row, silu * up, mask=ok)


@triton.jit
def _rotary_dim(row, HALF: tl.constexpr):
    """The head dimension of interleaved row ``row`` (`interleave_rotary`: 16-row tile ``j`` of
    a head holds dimensions ``8j .. 8j + 7``, then ``HALF + 8j ..``; the first of the pair)."""
    return 8 * ((row % (2 * HALF)) // 16) + row % 8


@triton.jit
def _rotary_inputs(row, tok, T, N, cos_ptr, sin_ptr, pos_ptr, slot_ptr, HALF: tl.constexpr):
    """``(cos, sin, slot)`` of the rotary epilogue's elements (row ``row``, token ``tok``): the
    cos/sin of the token's position at the row's dimension, and the token's cache slot (-1
    where the element is past the call's rows or tokens)."""
    ok = (row < N) & (tok < T)
    tok64 = tok.to(tl.int64)
    pos = tl.load(pos_ptr + tok64, mask=ok, other=0)
    d = _rotary_dim(row, HALF)
    c = tl.load(cos_ptr + pos * HALF + d, mask=ok, other=0.0)
    s = tl.load(sin_ptr + pos * HALF + d, mask=ok, other=0.0)
    slot = tl.load(slot_ptr + tok64, mask=ok, other=-1)
    return c, s, slot


@triton.jit
def _rotary_epilogue(
    acc1,
    acc2,
    row,
    tok,
    T,
    N,
    bias_ptr,
    q_ptr,
    c,
    s,
    slot,
    cache_ptr,
    cache_kv_stride,
    k_scale,
    v_scale,
    TILES: tl.constexpr,
    WARPS_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    FP8: tl.constexpr,
):
    """A merged q/k/v projection's sums, rows interleaved by `interleave_rotary`, as
    `pointwise._qkv_rotary_write` takes the unfused product: ``acc1`` of (interleaved) row
    ``row`` is dimension ``d`` of its head and ``acc2`` (row + 8) dimension ``d + HALF``. Each
    rounded to q's dtype as the Int4Gemm's output is; q and k rotated by
    `pointwise.rotate_halves` (the unfused kernel's function, its fmas spelled out, so the
    same bits); q stored, k and v written to the token's cache slot (none where the slot is
    negative: padding). ``c``, ``s``, ``slot``: the elements' `_rotary_inputs`, read before the
    wait."""
    D: tl.constexpr = 2 * HALF
    ty = q_ptr.dtype.element_ty
    x1 = _tile_sums(acc1, row, N, bias_ptr, TILES, WARPS_K, HAS_BIAS).to(ty)
    x2 = _tile_sums(acc2, row + 8, N, bias_ptr, TILES, WARPS_K, HAS_BIAS).to(ty)
    head = row // D
    d = _rotary_dim(row, HALF)
    ok = (row < N) & (tok < T)
    tok64 = tok.to(tl.int64)
    r1, r2 = rotate_halves(x1, x2, c, s, ty)
    is_q = head < HEADS
    q_at = q_ptr + tok64 * (HEADS * D) + head * D + d
    tl.store(q_at, r1, mask=ok & is_q)
    tl.store(q_at + HALF, r2, mask=ok & is_q)
    is_v = head >= HEADS + KV_HEADS
    kv_ok = ok & (head >= HEADS) & (slot >= 0)
    kv_head = tl.where(is_v, head - HEADS - KV_HEADS, head - HEADS)
    dst = cache_ptr + slot.to(tl.int64) * (KV_HEADS * D) + kv_head * D + d
    dst += tl.where(is_v, cache_kv_stride, 0)
    scale = tl.where(is_v, v_scale, k_scale)
    cty = cache_ptr.dtype.element_ty
    tl.store(dst, to_cache(tl.where(is_v, x1, r1), scale, cty, FP8), mask=kv_ok)
    tl.store(dst + HALF, to_cache(tl.where(is_v, x2, r2), scale, cty, FP8), mask=kv_ok)


@triton.jit
def _tile_sums(
    acc,
    row,
    N,
    bias_ptr,
    TILES: tl.constexpr,
    WARPS_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """A tile's sums ``[TILES, 32]`` in fp32: the WARPS_K warps' accumulators added, then the
    bias of each lane's row."""
    total = tl.sum(tl.reshape(acc, (TILES, WARPS_K, 32)), axis=1)
    if HAS_BIAS:
        total += tl.load(bias_ptr + row, mask=row < N, other=0.0).to(tl.float32)
    return total


@dataclass(frozen=True)
class FragmentPlan:
    """How `_int4_fragment` is launched: ``tiles`` 16-row tiles a program, ``warps_k`` warps
    sharing each tile's columns (the program's warps: tiles * warps_k); ``evict_first``: the
    words are loaded with L2's evict-first policy (read once a step)."""

    tiles: int = 1
    warps_k: int = 4
    evict_first: bool = False


# The fragment kernel serves decode calls: up to 8 tokens one mma a step, 9..16 two mma's a
# step, 17..32 in launches of at most 16 (on most shapes faster there than dequantizing the
# layer for cuBLAS). Longer calls dequantize the layer and multiply with cuBLAS
# (`fragment_matmul`). Measurements: docs/gpu-kernels.md, "One layout".
ONE_MMA_TOKENS = 8
LAUNCHES_MAX_TOKENS = 32
# Two mma's a step: a lane's share at most 48 steps unless the layer has many tiles (more than
# 512: the programs fill the SMs anyway); the fastest of 4 / 8 / 16 warps a tile
# (docs/gpu-kernels.md, "One layout").
TWO_MMA_MANY_TILES = 512


def fragment_plan(tokens: int, n: int, k: int, group_size: int) -> FragmentPlan | None:
    """The plan for one launch of ``tokens`` on ``[n, k]``, or None where the fragment kernel
    does not apply (`fragment_supports`, more than 16 tokens). ``warps_k``: the fewest warps a
    tile (4 or 8) that keep a lane's share of the weight at most 96 steps (384 bytes), with two
    mma's see above; at one mma that gives the fastest choice at K = 4096 (4 warps) and K =
    11008 (8)."""
    if fragment_supports(n, k, group_size) or not 1 <= tokens <= MAX_TOKENS:
        return None
    two = tokens > ONE_MMA_TOKENS
    limit = 48 if two and n // TILE_ROWS <= TWO_MMA_MANY_TILES else LANE_STEPS
    warps_k = 4
    while warps_k < MAX_WARPS_K and lane_steps(k, group_size, warps_k) > limit:
        warps_k *= 2
    return FragmentPlan(tiles=1, warps_k=warps_k)


@functools.cache
def fragment_launches(
    tokens: int, n: int, k: int, group_size: int
) -> tuple[tuple[int, int, FragmentPlan], ...] | None:
    """The kernel launches of a call of ``tokens``, ``(first token, end, plan)`` each: launches
    of up to 16 tokens, for calls of at most 32; None where the call should go to
    `fragment_matmul` (or the layer is not taken). Cached: eager steps ask for every layer."""
    if fragment_supports(n, k, group_size) or not 1 <= tokens <= LAUNCHES_MAX_TOKENS:
        return None
    return tuple(
        (
            a,
            min(tokens, a + MAX_TOKENS),
            fragment_plan(min(tokens, a + MAX_TOKENS) - a, n, k, group_size),
        )
        for a in range(0, tokens, MAX_TOKENS)
    )


def fragment_extra_bytes(quantized_linear_bytes: int, group_size: int) -> int:
    """Device bytes an INT4 artifact whose quantized Linears hold ``quantized_linear_bytes``
    (packed weights, 2-byte scales and 1-byte zeros: ``N K (1/2 + 3/g)``) gains when every
    Linear is held in the fragment layout instead: its records take 4 bytes a row and group
    where scales and zeros took 3 (the words are the packed bytes, reordered)."""
    g = group_size
    return int(quantized_linear_bytes * (1 / g) / (0.5 + 3 / g)) + 1


@functools.cache
def _asm_text(
    chunk: int, spg: int, two: bool, pdl_on: bool, evict_first: bool, bf16: bool = False
) -> tuple[str, str]:
    """The asm and its constraints: the accumulators, then the operands `_int4_fragment`
    passes (addresses as 64-bit integers, nvalid as 32)."""
    ins = ["l", "l", "l"] + (["l"] if two else []) + ["r"]
    return (
        _warp_asm(chunk, spg, two, pdl_on, evict_first, bf16),
        ",".join(["=f"] * (8 if two else 4) + ins),
    )


@dataclass(frozen=True)
class RotaryWrite:
    """What a merged q/k/v projection's epilogue does with its product (``rotary=``): the
    operands of `pointwise.qkv_rotary_write`, which it replaces. ``cos`` / ``sin`` ``[max_pos,
    D/2]``, ``positions`` and ``slot_mapping`` one a token, ``kv_cache [2, blocks, block_size,
    KV, D]`` (fp16/bf16, or FP8 with the scales)."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int
    num_kv_heads: int
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def head_dim(self) -> int:
        return 2 * self.cos.shape[-1]

    def write(self, qkv: torch.Tensor) -> torch.Tensor:
        """The unfused write on a plain ``[T, (H + 2 KV) D]`` product: returns q."""
        return qkv_rotary_write(
            qkv,
            self.cos,
            self.sin,
            self.positions,
            self.kv_cache,
            self.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
            self.k_scale,
            self.v_scale,
        )


def rotary_refusal(out_features: int, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why a layer of ``out_features`` rows cannot end in the rotary epilogue, or None if it
    can: its rows must be the q/k/v heads, of a multiple of 16 dimensions
    (`interleave_rotary`)."""
    if out_features != (heads + 2 * kv_heads) * head_dim or head_dim % 16:
        return (
            f"a rotary epilogue needs q/k/v rows ({heads} + 2 x {kv_heads} heads of "
            f"{head_dim}, {head_dim} a multiple of 16), got {out_features} rows"
        )
    return None


def int4_gemm_fragment(
    x: torch.Tensor,
    weight: FragmentWeight,
    bias: torch.Tensor | None = None,
    *,
    plan: FragmentPlan | None = None,
    out: torch.Tensor | None = None,
    swiglu: bool = False,
    rotary: RotaryWrite | None = None,
) -> torch.Tensor:
    """``y [T, N] = x @ dequantize(W).T + bias`` for ``x [T, K]`` in the weight's dtype (fp16
    or bf16), 1 <= T <= 32 in the launches `fragment_launches` gives (CUDA; Triton's CPU
    interpreter runs the portable version). ``plan`` (1..16 tokens) makes it one launch of that
    plan instead. ``swiglu``: the weight is a gate/up projection with its rows interleaved
    (`interleave_gate_up`) and y is ``[T, N/2]``, SwiGLU of the product (the gate and up rows
    of each output are in one lane's accumulators: no second kernel, no ``[T, N]`` in memory).
    ``rotary``: the weight is a merged q/k/v projection with each head's rows interleaved
    (`interleave_rotary`); y is the rotated q ``[T, heads * D]`` and the rotated k and v are
    written to their cache slots, as `pointwise.qkv_rotary_write` does with the plain product
    (the two halves of a rotation are in one lane's accumulators)."""
    n, k = weight.out_features, weight.in_features
    if rotary is not None:
        why = rotary_refusal(n, rotary.num_heads, rotary.num_kv_heads, rotary.head_dim)
        if why:
            raise ValueError(f"Int4Gemm fragment kernel: {why}")
    x2 = x.reshape(-1, k).contiguous()
    tokens = x2.shape[0]
    most = MAX_TOKENS if plan else LAUNCHES_MAX_TOKENS
    if x2.dtype != weight.dtype or not 1 <= tokens <= most:
        raise ValueError(
            f"Int4Gemm fragment kernel: x of 1..{most} tokens in the "
            f"weight's {weight.dtype}, got {x2.dtype} x {tokens}"
        )
    if x2.data_ptr() % 16:
        raise ValueError(
            "Int4Gemm fragment kernel: x must be 16-byte aligned (its B fragments "
            "are 16-byte loads); pass a fresh or .clone()d tensor"
        )
    launches = ((0, tokens, plan),) if plan else fragment_launches(tokens, n, k, weight.group_size)
    if launches is None:
        raise ValueError(
            f"Int4Gemm fragment kernel: not for {tokens} tokens on [{n}, {k}] "
            f"(fragment_launches); call fragment_matmul"
        )
    width = n // 2 if swiglu else n
    if rotary is not None:
        width = rotary.num_heads * rotary.head_dim
    y = out if out is not None else torch.empty((tokens, width), dtype=x.dtype, device=x.device)
    for first, end, p in launches:  # a launch's x rows stay 16-byte aligned: K % 64 == 0
        _launch(x2[first:end], weight, bias, p, y[first:end], swiglu, rotary, first)
    return y.view(*x.shape[:-1], width)


def _launch(
    x2: torch.Tensor,
    weight: FragmentWeight,
    bias: torch.Tensor | None,
    plan: FragmentPlan,
    y: torch.Tensor,
    swiglu: bool = False,
    rotary: RotaryWrite | None = None,
    first: int = 0,
) -> None:
    """One launch over the call's tokens ``first ..`` (x2 and y are those rows already; the
    rotary's positions and slots are indexed from ``first``)."""
    n, k = weight.out_features, weight.in_features
    tokens = x2.shape[0]
    spg = weight.group_size // STEP_COLS
    groups = weight.groups
    chunk = -(-groups // plan.warps_k)
    two = tokens > ONE_MMA_TOKENS
    asm = not _interpreting()
    launch = pdl.launch_options(x2.device)
    bf16 = weight.dtype == torch.bfloat16
    text, constraints = (
        _asm_text(chunk, spg, two, launch["PDL"], plan.evict_first, bf16) if asm else ("", "")
    )
    bias_arg = bias.contiguous() if bias is not None else y
    _int4_fragment[(-(-(n // TILE_ROWS) // plan.tiles),)](
        x2,
        weight.words,
        weight.records,
        bias_arg,
        y,
        tokens,
        n,
        k,
        groups,
        TILES=plan.tiles,
        WARPS_K=plan.warps_k,
        CHUNK=chunk,
        SPG=spg,
        TWO=two,
        BF16=bf16,
        HAS_BIAS=bias is not None,
        ASM=asm,
        ASM_TEXT=text,
        CONSTRAINTS=constraints,
        SWIGLU=swiglu,
        **_rotary_operands(rotary, y, first),
        num_warps=plan.tiles * plan.warps_k,
        **launch,
    )


def _rotary_operands(rotary: RotaryWrite | None, y: torch.Tensor, first: int) -> dict:
    """`_int4_fragment`'s rotary operands for a launch from token ``first`` (y in their place
    where there is no rotary: unused)."""
    if rotary is None:
        return dict(
            cos_ptr=y, sin_ptr=y, pos_ptr=y, slot_ptr=y, cache_ptr=y, cache_kv_stride=0,
            k_scale=1.0, v_scale=1.0, ROTARY=False, HEADS=1, KV_HEADS=1, HALF=8, FP8=False,
        )  # fmt: skip
    cache = rotary.kv_cache
    return dict(
        cos_ptr=rotary.cos,
        sin_ptr=rotary.sin,
        pos_ptr=rotary.positions.reshape(-1)[first:],
        slot_ptr=rotary.slot_mapping.reshape(-1)[first:],
        cache_ptr=cache,
        cache_kv_stride=cache.stride(0),
        k_scale=float(rotary.k_scale),
        v_scale=float(rotary.v_scale),
        ROTARY=True,
        HEADS=rotary.num_heads,
        KV_HEADS=rotary.num_kv_heads,
        HALF=rotary.head_dim // 2,
        FP8=cache.dtype == torch.float8_e4m3fn,
    )


# --- calls of more than 32 tokens: the layer dequantized, then cuBLAS -------------------------


@triton.jit
def _dequantize_fragments(
    words_ptr,
    records_ptr,
    w_ptr,
    K,
    G,
    GROUP: tl.constexpr,
    BLOCKS: tl.constexpr,
    BF16: tl.constexpr,
):
    """``W [N, K] = (q - z) * s`` (fp32, rounded once to the records' dtype) from the fragment
    layout: a program writes one 16-row tile's ``BLOCKS`` blocks of 64 columns. One element a
    word (``BLOCKS * 128`` contiguous words): word ``16 g + cu`` of block ``b`` (``cu = 4 c +
    u``: lane ``4 g + c``'s step ``u``) holds rows ``g`` (nibbles ``m`` even) and ``g + 8`` (odd)
    at columns ``64 b + 4 cu + kk``, ``kk = 2 kh + kl`` being nibble ``m = hb + 2 kh + 4 kl``
    (module docstring); each row half is stored as ``[words, 4]`` (8 contiguous bytes a word),
    the fastest of the layouts tried (docs/gpu-kernels.md, "One layout")."""
    r = tl.program_id(0).to(tl.int64)
    blocks = K // 64
    word_i = tl.arange(0, BLOCKS * 128)
    b = tl.program_id(1) * BLOCKS + word_i // 128
    g = (word_i // 16) % 8
    col = 64 * b + 4 * (word_i % 16)
    ok = b < blocks
    word = tl.load(
        words_ptr + (r * blocks + tl.program_id(1) * BLOCKS) * 128 + word_i, mask=ok, other=0
    )
    kk = tl.arange(0, 4)
    # The record of (tile, group, g): -(magic + z) of rows g and g + 8, then their scales.
    rec = records_ptr + ((r * G + (b * 64) // GROUP) * 8 + g) * 4
    for hb in tl.static_range(2):
        q = (word[:, None] >> (4 * hb + 16 * (kk % 2) + 8 * (kk // 2))[None, :]) & 0xF
        minus_z = tl.load(rec + hb, mask=ok, other=0.0).to(tl.float32) + (
            128.0 if BF16 else (64.0 if hb else 1024.0)
        )
        scale = tl.load(rec + 2 + hb, mask=ok, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) + minus_z[:, None]) * scale[:, None]
        row = 16 * r + 8 * hb + g
        tl.store(
            w_ptr + (row * K + col)[:, None] + kk[None, :],
            w.to(w_ptr.dtype.element_ty),
            mask=ok[:, None],
        )


DEQUANT_BLOCKS = 8  # 64-column blocks a program: 16 x 512 weights


def fragment_dequantize(
    weight: FragmentWeight, out: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The layer's weight ``[N, K]`` from the fragment layout, in ``dtype``: the weight's (the
    default) or fp32 (exact) (CUDA; Triton's CPU interpreter too). ``out``: a contiguous ``[N,
    K]`` tensor of that dtype to write into."""
    n, k = weight.out_features, weight.in_features
    dtype = dtype or (out.dtype if out is not None else weight.dtype)
    w = out if out is not None else torch.empty((n, k), dtype=dtype, device=weight.words.device)
    if (
        tuple(w.shape) != (n, k)
        or w.dtype != dtype
        or dtype not in (weight.dtype, torch.float32)
        or not w.is_contiguous()
    ):
        raise ValueError(
            f"Int4Gemm fragment dequantize: out must be a contiguous {weight.dtype} "
            f"or torch.float32 [{n}, {k}], got {w.dtype} {list(w.shape)}"
        )
    grid = (n // TILE_ROWS, -(-(k // 64) // DEQUANT_BLOCKS))
    _dequantize_fragments[grid](
        weight.words,
        weight.records,
        w,
        k,
        weight.groups,
        GROUP=weight.group_size,
        BLOCKS=DEQUANT_BLOCKS,
        BF16=weight.dtype == torch.bfloat16,
        num_warps=4,
    )
    return w


def fragment_matmul(
    x: torch.Tensor, weight: FragmentWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = x @ dequantize(W).T + bias`` for any number of tokens, in x's dtype: the layer
    dequantized into a transient ``[N, K]`` (the largest projection's fp16 bytes at most,
    reserved by the executor, `trtc.runtime.executors.fusions.int4_fragment.int4_fragment_bytes`)
    and multiplied by cuBLAS in the weight's dtype, or in fp32 where x has another dtype. What
    calls of more than 32 tokens run (prefill: faster than the plugin-layout kernel's in-loop
    dequantization; docs/gpu-kernels.md, "One layout")."""
    k = weight.in_features
    x2 = x.reshape(-1, k)
    w = fragment_dequantize(weight, dtype=None if x2.dtype == weight.dtype else torch.float32)
    y = torch.nn.functional.linear(x2.to(w.dtype), w, None if bias is None else bias.to(w.dtype))
    return y.to(x.dtype).view(*x.shape[:-1], weight.out_features)


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """The rows of a gate/up projection ``[2I, ...]`` (gate rows, then up rows) reordered so
    that 16-row tile ``r`` holds gate rows ``8r .. 8r + 7`` then up rows ``8r .. 8r + 7``: what
    ``swiglu=True`` takes (I a multiple of 8)."""
    n = t.shape[0]
    if n % 16:
        raise ValueError(f"interleave_gate_up: {n} rows is not 2 x a multiple of 8")
    return t.reshape(2, n // 16, 8, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def deinterleave_gate_up(y: torch.Tensor) -> torch.Tensor:
    """``y [..., 2I]`` of an interleaved gate/up weight back to gate columns, then up columns."""
    n = y.shape[-1]
    lead = y.shape[:-1]
    return y.reshape(*lead, n // 16, 2, 8).transpose(-3, -2).reshape(*lead, n)


def interleave_rotary(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The rows of a merged q/k/v projection ``[heads * D, ...]`` reordered within each head so
    that 16-row tile ``j`` of a head holds its dimensions ``8j .. 8j + 7`` then ``D/2 + 8j ..
    D/2 + 8j + 7``: the two halves of each rotation in one lane (what ``rotary=`` takes; D a
    multiple of 16). v's heads are reordered alike (the epilogue puts them back)."""
    n, d = t.shape[0], head_dim
    if d % 16 or n % d:
        raise ValueError(f"interleave_rotary: {n} rows is not heads of {d} (a multiple of 16)")
    return t.reshape(n // d, 2, d // 16, 8, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def deinterleave_rotary(y: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``y [..., heads * D]`` of an `interleave_rotary` weight back to the plain column order."""
    n, d = y.shape[-1], head_dim
    lead = y.shape[:-1]
    return y.reshape(*lead, n // d, d // 16, 2, 8).transpose(-3, -2).reshape(*lead, n)


def fragment_gemm(
    x: torch.Tensor, weight: FragmentWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """An Int4Gemm on the fragment layout, as the CUDA executor runs it: the kernel's launches
    (`fragment_launches`: 1..32 tokens) where x is in the weight's dtype and 16-byte aligned
    (a step's activations are), else `fragment_matmul`."""
    if _kernel_takes(x, weight):
        return int4_gemm_fragment(x, weight, bias)
    return fragment_matmul(x, weight, bias)


def fragment_gemm_swiglu(
    x: torch.Tensor,
    weight: FragmentWeight,
    swiglu: Callable[[torch.Tensor], torch.Tensor],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU of a gate/up Int4Gemm whose rows (and bias) are interleaved
    (`interleave_gate_up`), as the CUDA executor runs it: the kernel with SwiGLU in its
    epilogue where `fragment_gemm` runs the kernel, else `fragment_matmul`, the columns put
    back in order and ``swiglu`` (the executor's own op: both paths give the unfused nodes'
    bits)."""
    if _kernel_takes(x, weight):
        return int4_gemm_fragment(x, weight, bias, swiglu=True)
    return swiglu(deinterleave_gate_up(fragment_matmul(x, weight, bias)))


def fragment_gemm_rotary(
    x: torch.Tensor,
    weight: FragmentWeight,
    rotary: RotaryWrite,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A merged q/k/v Int4Gemm whose rows (and bias) are interleaved (`interleave_rotary`),
    then q and k rotated and k and v written to the cache, as the CUDA executor runs it: the
    kernel with that in its epilogue where `fragment_gemm` runs the kernel, else
    `fragment_matmul`, the columns put back in order and the unfused write (`RotaryWrite.write`,
    what the executor's ``QKVRotaryCacheWrite`` runs: both paths give the unfused nodes'
    bits). Returns q."""
    if _kernel_takes(x, weight):
        return int4_gemm_fragment(x, weight, bias, rotary=rotary)
    qkv = deinterleave_rotary(fragment_matmul(x, weight, bias), rotary.head_dim)
    return rotary.write(qkv.reshape(-1, weight.out_features))


def _kernel_takes(x: torch.Tensor, weight: FragmentWeight) -> bool:
    """The kernel's launches take this call: x in the weight's dtype, 16-byte aligned, 1..32
    tokens on a layer it takes."""
    tokens = x.numel() // weight.in_features
    return (
        x.dtype == weight.dtype
        and x.data_ptr() % 16 == 0
        and fragment_launches(tokens, weight.out_features, weight.in_features, weight.group_size)
        is not None
    )
