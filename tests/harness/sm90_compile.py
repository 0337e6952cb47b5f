"""Compile Triton kernels for sm_90 on a machine without a GPU and read what ptxas says of them
(registers, spills): a probe script run in a subprocess outside Triton's CPU interpreter (which
the test session turns on), with `PTXAS_REPORT` at its top."""

from __future__ import annotations

import os
import subprocess
import sys

# Defines in a probe ``compile_sm90(fn, signature, constexprs, attrs=None, aligned=(), **options)
# -> asm`` (the constexprs added to the signature; attrs default to 16-byte-aligned pointers and
# the ``aligned`` integers multiples of 16) and
# ``ptxas_report(ptx) -> (registers, spill_store_bytes, spill_load_bytes)``.
PTXAS_REPORT = r"""
import re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas

SM90 = GPUTarget("cuda", 90, 32)


def compile_sm90(fn, signature, constexprs, attrs=None, aligned=(), **options):
    # Without attrs, every pointer 16-byte aligned and the integers named in ``aligned``
    # multiples of 16: what Triton's launcher specializes on (torch's allocations; integer
    # arguments divisible by 16), and what lets it vectorize loads (a compile without it assumes
    # nothing and reads 2 bytes a load, with other registers and spills than the real launch).
    if attrs is None:
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
                 for name, kind in signature.items() if kind.startswith("*") or name in aligned}
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=SM90, options=options).asm


def ptxas_report(ptx):
    with tempfile.TemporaryDirectory() as d:
        open(f"{d}/k.ptx", "w").write(ptx)
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o",
                                 f"{d}/k.cubin"], capture_output=True, text=True, check=True).stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    stores = sum(int(a) for a, _ in spills)
    loads = sum(int(b) for _, b in spills)
    return int(re.search(r"Used (\d+) registers", report).group(1)), stores, loads
"""


def run_probe(probe: str) -> list[str]:
    """A probe's output lines, run outside Triton's interpreter (Triton ships ptxas: the PTX
    must also assemble)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PTXAS_REPORT + probe],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()
