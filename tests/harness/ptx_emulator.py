"""A numpy emulator of one warp running the inline PTX of the Int4Gemm fragment kernel
(`plugins/int4_gemm/fragment_kernel._warp_asm`), so that CI without a GPU checks the asm itself,
not only the portable version the interpreter runs. It knows the instructions that asm uses and
nothing else (an unknown one is an error), with their PTX ISA semantics: per-lane registers
(a ``mov`` between 32-bit types keeps the bits), predicated execution, global loads from one
byte array (out of bounds is an error), f16x2 / bf16x2 arithmetic rounded to fp16 / bf16, and
``mma.sync.m16n8k16`` with the ISA's fragment layout."""

from __future__ import annotations

import re

import numpy as np

LANES = 32
_TYPES = {
    ".b16": np.uint16,
    ".b32": np.uint32,
    ".b64": np.uint64,
    ".f32": np.float32,
    ".pred": np.bool_,
}


class WarpEmulator:
    def __init__(self, memory: np.ndarray):
        self.memory = memory  # uint8: every address the asm may read
        self.regs: dict[str, np.ndarray] = {}

    # --- operands ----------------------------------------------------------------------------
    def _declare(self, line: str) -> None:
        kind, names = line[len(".reg ") :].rstrip(";").split(" ", 1)
        for name in (n.strip() for n in names.split(",")):
            m = re.fullmatch(r"(\w+)<(\d+)>", name)
            for reg in [f"{m.group(1)}{i}" for i in range(int(m.group(2)))] if m else [name]:
                self.regs[reg] = np.zeros(LANES, dtype=_TYPES[kind])

    def _value(self, text: str, dtype=np.uint32) -> np.ndarray:
        text = text.strip()
        if text in self.regs:
            return self.regs[text]
        if text.startswith("0f"):
            return np.full(LANES, np.uint32(int(text[2:], 16)).view(np.float32))
        return np.full(LANES, int(text, 0), dtype=dtype)

    def _set(self, name: str, value: np.ndarray, pred: np.ndarray) -> None:
        reg = self.regs[name]
        reg[pred] = value.astype(reg.dtype, copy=False)[pred]

    def _address(self, text: str) -> np.ndarray:
        m = re.fullmatch(r"\[(\$?\w+)(?:\+(\d+))?\]", text.strip())
        return self._value(m.group(1), np.uint64).astype(np.uint64) + np.uint64(m.group(2) or 0)

    def _load(self, addr: np.ndarray, nbytes: int, pred: np.ndarray) -> np.ndarray:
        out = np.zeros((LANES, nbytes), dtype=np.uint8)
        for lane in np.flatnonzero(pred):
            a = int(addr[lane])
            if a % nbytes or a < 0 or a + nbytes > self.memory.size:
                raise IndexError(
                    f"lane {lane}: a {nbytes}-byte load at {a} is misaligned or "
                    f"outside the {self.memory.size} bytes"
                )
            out[lane] = self.memory[a : a + nbytes]
        return out

    # --- the program -------------------------------------------------------------------------
    def run(self, asm: str, constraints: str, operands: list[np.ndarray]) -> list[np.ndarray]:
        """Execute ``asm`` with ``$i`` bound to outputs then ``operands`` (per lane arrays, in
        the order of ``constraints``); returns the outputs."""
        kinds = constraints.split(",")
        outs = [k for k in kinds if k.startswith("=")]
        for i, kind in enumerate(kinds):
            if kind.startswith("="):
                self.regs[f"${i}"] = np.zeros(LANES, dtype=np.float32)
            else:  # integers (addresses, counts) as the register's unsigned bits
                dtype = {"l": np.uint64, "r": np.uint32}[kind]
                self.regs[f"${i}"] = (
                    np.asarray(operands[i - len(outs)]).astype(np.int64).astype(dtype)
                )
        for raw in asm.splitlines():
            line = raw.strip()
            if not line or line in "{}":
                continue
            if line.startswith(".reg"):
                self._declare(line)
                continue
            self._step(line)
        return [self.regs[f"${i}"].copy() for i in range(len(outs))]

    def _step(self, line: str) -> None:
        """One instruction: its predicate, then the family that knows its opcode."""
        pred = np.ones(LANES, dtype=bool)
        m = re.match(r"@(!?)(\w+)\s+(.*)", line)
        if m:
            pred = ~self.regs[m.group(2)] if m.group(1) else self.regs[m.group(2)].copy()
            line = m.group(3)
        op, _, rest = line.rstrip(";").partition(" ")
        args = _split_operands(rest)
        if op.split(".")[0] in ("griddepcontrol", "createpolicy"):
            return  # ordering and cache hints only
        for family in (self._move, self._integer, self._bitwise, self._float, self._memory):
            if family(op, args, pred):
                return
        raise NotImplementedError(f"the emulator does not know {op!r}")

    def _move(self, op: str, args: list[str], pred: np.ndarray) -> bool:
        """``mov``: into a register, or a 32-bit value split into two 16-bit ones."""
        if op == "mov.b32" and args[0].startswith("{"):
            lo, hi = (s.strip() for s in args[0][1:-1].split(","))
            v = self._value(args[1])
            self._set(lo, v & 0xFFFF, pred)
            self._set(hi, v >> 16, pred)
        elif op.split(".")[0] == "mov":
            dtype = _TYPES["." + op.split(".")[-1]]
            value, reg = self._value(args[1], dtype), self.regs[args[0]]
            if value.dtype != reg.dtype and value.dtype.itemsize == reg.dtype.itemsize:
                value = value.view(reg.dtype)  # the bits, not the number
            self._set(args[0], value, pred)
        else:
            return False
        return True

    def _integer(self, op: str, args: list[str], pred: np.ndarray) -> bool:
        """Comparisons, predicates, 64-bit addresses and selects."""
        if op == "setp.gt.s32":
            self._set(
                args[0],
                self._value(args[1]).astype(np.int64).astype(np.int32) > int(args[2], 0),
                pred,
            )
        elif op == "and.pred":
            self._set(args[0], self._value(args[1]) & self._value(args[2]), pred)
        elif op == "add.s64":
            self._set(
                args[0],
                self._value(args[1], np.uint64).astype(np.uint64)
                + self._value(args[2], np.uint64).astype(np.uint64),
                pred,
            )
        elif op == "selp.b64":
            self._set(
                args[0],
                np.where(
                    self._value(args[3]),
                    self._value(args[1], np.uint64),
                    self._value(args[2], np.uint64),
                ),
                pred,
            )
        else:
            return False
        return True

    def _bitwise(self, op: str, args: list[str], pred: np.ndarray) -> bool:
        """Shifts, ``and``, byte permutes and three-input logic on 32-bit registers."""
        if op == "shr.b32":
            self._set(args[0], self._value(args[1]) >> np.uint32(int(args[2], 0)), pred)
        elif op == "shl.b32":
            self._set(args[0], self._value(args[1]) << np.uint32(int(args[2], 0)), pred)
        elif op == "and.b32":
            self._set(args[0], self._value(args[1]) & self._value(args[2]), pred)
        elif op == "prmt.b32":
            self._set(
                args[0], _prmt(self._value(args[1]), self._value(args[2]), int(args[3], 0)), pred
            )
        elif op == "lop3.b32":
            self._set(
                args[0],
                _lop3(
                    self._value(args[1]),
                    self._value(args[2]),
                    self._value(args[3]),
                    int(args[4], 0),
                ),
                pred,
            )
        else:
            return False
        return True

    def _float(self, op: str, args: list[str], pred: np.ndarray) -> bool:
        """Half-pair and fp32 arithmetic, the fp16 -> fp32 conversion and ``mma.sync``."""
        if op in ("add.f16x2", "fma.rn.f16x2", "fma.rn.bf16x2"):
            bf16 = "bf16" in op
            vals = [_halves(self._value(a), bf16) for a in args[1:]]
            exact = vals[0] + vals[1] if op == "add.f16x2" else vals[0] * vals[1] + vals[2]
            self._set(args[0], _pack_halves(exact, bf16), pred)
        elif op == "cvt.f32.f16":
            self._set(
                args[0],
                self._value(args[1], np.uint16)
                .astype(np.uint16)
                .view(np.float16)
                .astype(np.float32),
                pred,
            )
        elif op == "fma.rn.f32":
            a, b, c = (_as_f32(self._value(x)).astype(np.float64) for x in args[1:])
            self._set(args[0], (a * b + c).astype(np.float32), pred)
        elif op in (
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        ):
            if not pred.all():
                raise ValueError("mma.sync under a per-lane predicate")
            self._mma(*(a[1:-1].split(",") for a in args), bf16="bf16" in op)
        else:
            return False
        return True

    def _memory(self, op: str, args: list[str], pred: np.ndarray) -> bool:
        """``ld``: one, two or four 32-bit words a lane from global memory."""
        if op.split(".")[0] != "ld":
            return False
        nbytes = {"v4": 16, "v2": 8}.get(op.split(".")[-2], 4)
        data = self._load(self._address(args[1]), nbytes, pred).view(np.uint32)
        names = args[0][1:-1].split(",") if args[0].startswith("{") else [args[0]]
        for j, name in enumerate(names):
            self._set(name.strip(), data[:, j], pred)
        return True

    def _mma(self, d, a, b, c, bf16=False) -> None:
        """D = A @ B + C for the warp: lane 4g + t holds A rows g, g + 8 at columns 2t, 2t + 1
        (a0 / a1) and 2t + 8, 2t + 9 (a2 / a3: registers of two halves each); B rows 2t, 2t + 1
        (b0) and 2t + 8, 2t + 9 (b1) of column g; C and D rows g, g + 8 at columns 2t, 2t + 1."""
        A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
        av = [_halves(self._value(r), bf16).reshape(LANES, 2) for r in a]
        bv = [_halves(self._value(r), bf16).reshape(LANES, 2) for r in b]
        cv = [self._value(r).astype(np.float64) for r in c]
        for lane in range(LANES):
            g, t = divmod(lane, 4)
            for h in range(2):
                A[g, 2 * t + h], A[g + 8, 2 * t + h] = av[0][lane, h], av[1][lane, h]
                A[g, 2 * t + 8 + h], A[g + 8, 2 * t + 8 + h] = av[2][lane, h], av[3][lane, h]
                B[2 * t + h, g], B[2 * t + 8 + h, g] = bv[0][lane, h], bv[1][lane, h]
                C[g, 2 * t + h], C[g + 8, 2 * t + h] = cv[h][lane], cv[2 + h][lane]
        D = A @ B + C
        out = [np.zeros(LANES, dtype=np.float32) for _ in range(4)]
        for lane in range(LANES):
            g, t = divmod(lane, 4)
            for h in range(2):
                out[h][lane], out[2 + h][lane] = D[g, 2 * t + h], D[g + 8, 2 * t + h]
        for name, value in zip(d, out):
            self.regs[name.strip()][:] = value


def _split_operands(text: str) -> list[str]:
    """Operands separated by commas outside braces and brackets."""
    out, depth, current = [], 0, ""
    for ch in text:
        depth += (ch in "{[") - (ch in "}]")
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    return out + [current.strip()] if current.strip() else out


def _as_f32(v: np.ndarray) -> np.ndarray:
    """A 32-bit register read by an .f32 instruction: its bits as fp32."""
    return v.view(np.float32) if v.dtype == np.uint32 else v


def _halves(v: np.ndarray, bf16: bool = False) -> np.ndarray:
    """uint32 per lane -> float64 [lanes * 2]: low half first (fp16, or bf16: the upper half
    of an fp32)."""
    halves = np.ascontiguousarray(v.astype(np.uint32)).view(np.uint16)
    if bf16:
        return (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return halves.view(np.float16).astype(np.float64)


def _pack_halves(x: np.ndarray, bf16: bool = False) -> np.ndarray:
    if bf16:  # round to nearest even on the 16 bits dropped from fp32
        bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return np.ascontiguousarray(bits.astype(np.uint16)).view(np.uint32)
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint32)


def _prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    """Byte permute: bytes 0-3 of ``a``, 4-7 of ``b``; result byte i = byte (selector >> 4i) & 7
    (the sign-replicating mode, bit 3, is not used by the kernel)."""
    src = np.concatenate(
        [
            a.astype(np.uint32).view(np.uint8).reshape(LANES, 4),
            b.astype(np.uint32).view(np.uint8).reshape(LANES, 4),
        ],
        axis=1,
    )
    picks = [(selector >> (4 * i)) & 0xF for i in range(4)]
    if any(p & 8 for p in picks):
        raise NotImplementedError("prmt sign replication")
    return np.ascontiguousarray(src[:, picks]).view(np.uint32).reshape(LANES)


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """Bitwise f(a, b, c) by its truth table: bit (a << 2 | b << 1 | c) of ``lut``."""
    a, b, c = (x.astype(np.uint32) for x in (a, b, c))
    out = np.zeros(LANES, dtype=np.uint32)
    for i in range(8):
        if lut >> i & 1:
            out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return out
