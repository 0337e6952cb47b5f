"""The read-only kernel of benchmarks/read_ceiling.py reads every word it is timed for (its XOR per
chunk), in Triton's CPU interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

from harness.benchmark_scripts import benchmark_script

pytest.importorskip("triton", reason="triton is not installed")
read_ceiling = benchmark_script("read_ceiling")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("evict_first", [False, True])
def test_read_only_kernel_xors_each_chunk(evict_first):
    chunk, programs = 64, 5
    words = torch.randint(
        -(2**31),
        2**31 - 1,
        (chunk * programs,),
        dtype=torch.int32,
        generator=torch.Generator().manual_seed(0),
    ).to(DEVICE)
    out = torch.zeros(programs, dtype=torch.int32, device=DEVICE)
    read_ceiling._read_only[(programs,)](
        words,
        words,
        out,
        CHUNK=chunk,
        PDL=False,
        EVICT_FIRST=evict_first,
        PREFETCH_NEXT=False,
        PIECES=32,
    )
    assert torch.equal(out, read_ceiling.xor_of_chunks(words, chunk))
