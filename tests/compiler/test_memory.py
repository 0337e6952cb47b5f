"""Peak resident memory per stage: a stage's allocation shows in its own peak, not the next's."""

from __future__ import annotations

import time

import pytest
import torch

from trtc.compiler import memory
from trtc.compiler.progress import Progress

MB = 1 << 20


def _touch(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)  # resident only once written
    return t


@pytest.mark.parametrize("exact", [True, False])
def test_each_stage_reports_its_own_peak(monkeypatch, exact):
    if memory.current_rss() is None:
        pytest.skip("no /proc on this OS: only the lifetime peak exists")
    if not exact:  # as on a kernel that refuses the high-water-mark reset
        monkeypatch.setattr(memory, "_reset_high_water_mark", lambda: False)
    progress = Progress(quiet=True)
    if exact and not progress.meter.uses_high_water_mark:
        pytest.skip("this kernel refuses the reset of the high-water mark")
    base = memory.current_rss()
    with progress.stage("big", "allocating"):
        t = _touch(300 * MB)
        time.sleep(0.1)  # the sampler's period is 20 ms
        del t
    with progress.stage("small", "allocating"):
        t = _touch(10 * MB)
        time.sleep(0.1)
        del t
    record = progress.memory_record()
    assert record["measured"] == progress.meter.how
    assert record["stages"]["big"] >= base + 290 * MB
    assert record["stages"]["small"] < record["stages"]["big"] - 200 * MB
    assert record["peak_rss_bytes"] == record["stages"]["big"]
    assert "peak" in progress.text()
