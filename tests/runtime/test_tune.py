"""`trtc tune` on the GPU: the tuned artifact serves from its shipped kernels (nothing compiled),
gives the same tokens, and a tuning recorded for another Triton or another architecture is
ignored with a warning (the server still serves)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from trtc.artifact import read_manifest, write_manifest
from trtc.runtime.executors.tuning import kernel_cache

pytestmark = pytest.mark.gpu


def trtc(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "trtc", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )


def compiled_beyond(cache, archive) -> list[str]:
    """The files in the unpacked kernel cache that the shipped archive does not hold: what
    Triton compiled at start (named, so a failure says which kernels)."""
    with tarfile.open(archive) as tar:
        shipped = {m.name for m in tar.getmembers() if m.isfile()}
    here = {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}
    return sorted(here - shipped)


def test_tuned_artifact_serves_without_compiling(tiny_artifacts, tmp_path, monkeypatch):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifacts["tiny-llama"], art)
    env = {"TRTC_CACHE_DIR": str(tmp_path / "cache"), "TRITON_CACHE_DIR": str(tmp_path / "t")}
    monkeypatch.setenv("TRTC_CACHE_DIR", env["TRTC_CACHE_DIR"])  # kernel_cache() below
    r = trtc("tune", str(art), env=env)
    assert r.returncode == 0, r.stderr
    m = read_manifest(art)
    ((arch, record),) = m.tuning.items()
    record_json = json.loads((art / record.file).read_text())
    assert record_json["kernels"]["files"] > 0 and "pdl" in record_json["timings"]
    r = trtc("inspect", str(art), env=env)
    assert arch in r.stdout and record.triton in r.stdout

    generate = ("generate", str(art), "Hello", "-n", "8", "--executor", "cuda")
    plain = trtc(*generate, env={**env, "TRTC_TUNING": "0"})
    assert plain.returncode == 0, plain.stderr
    first = trtc(*generate, env=env)  # unpacks the kernels
    assert first.returncode == 0, first.stderr
    assert "compiled at start" not in first.stderr  # the loader's warnings when it cannot
    cache = kernel_cache(m.files[record.kernels].sha256)
    # Triton writes what it compiles into the cache it is pointed at: the first tuned start
    # found every kernel it launched among the shipped ones.
    assert compiled_beyond(cache, art / record.kernels) == [], "a tuned start compiled kernels"
    again = trtc(*generate, env=env)
    assert again.returncode == 0, again.stderr
    assert compiled_beyond(cache, art / record.kernels) == [], "a tuned start compiled kernels"
    assert again.stdout == first.stdout == plain.stdout

    # The same tuning, recorded as made with another Triton: ignored, and it still serves.
    m.tuning[arch] = record.model_copy(update={"triton": "0.0.1"})
    write_manifest(art, m)
    other = trtc(*generate, env=env)
    assert other.returncode == 0, other.stderr
    assert "ignoring" in other.stderr and "Triton 0.0.1" in other.stderr
    assert other.stdout == plain.stdout

    # The same tuning, recorded for another architecture: ignored, and it still serves.
    other_arch = "sm80" if arch != "sm80" else "sm90"
    m.tuning = {other_arch: record}
    write_manifest(art, m)
    elsewhere = trtc(*generate, env=env)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert f"tuned for {other_arch}, not for this GPU" in elsewhere.stderr
    assert elsewhere.stdout == plain.stdout


def test_tuning_again_ships_the_kernels_again(tiny_artifacts, tmp_path, monkeypatch):
    """A tuned artifact tuned again (its kernels unpacked in the cache by a start in between)
    ships its kernels again: the tune must not load the artifact's current tuning, which
    would point Triton at the shipped kernels and leave the new archive empty."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifacts["tiny-llama"], art)
    env = {"TRTC_CACHE_DIR": str(tmp_path / "cache"), "TRITON_CACHE_DIR": str(tmp_path / "t")}
    monkeypatch.setenv("TRTC_CACHE_DIR", env["TRTC_CACHE_DIR"])  # kernel_cache() below
    generate = ("generate", str(art), "Hello", "-n", "4", "--executor", "cuda")
    for _ in range(2):
        r = trtc("tune", str(art), env=env)
        assert r.returncode == 0, r.stderr
        start = trtc(*generate, env=env)  # unpacks the kernels
        assert start.returncode == 0, start.stderr
    m = read_manifest(art)
    ((_, record),) = m.tuning.items()
    with tarfile.open(art / record.kernels) as tar:
        assert any(t.name.endswith(".cubin") for t in tar.getmembers())
    cache = kernel_cache(m.files[record.kernels].sha256)
    assert compiled_beyond(cache, art / record.kernels) == [], "a tuned start compiled kernels"
