"""A tuned artifact's loader decides, without a GPU, whether its kernels can serve here: the
same architecture, Triton, torch and CUDA, files whole. Anything else is a warning and None
(the executor then compiles at start: it still serves)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from trtc.artifact import Artifact, TuningRecord, file_record, read_manifest, write_manifest
from trtc.runtime.executors.tuning import (
    KernelEnvironment,
    Tuning,
    install_kernels,
    kernel_cache,
    load_tuning,
    tuning_files,
)
from trtc.runtime.tune import pack

HERE = KernelEnvironment(
    arch="sm90", device="NVIDIA H100 80GB HBM3", triton="3.6.0", torch="2.11.0", cuda="13.0"
)


@pytest.fixture
def tuned(tiny_artifacts, tmp_path, monkeypatch):
    """A copy of the tiny artifact with a tuning for HERE: one fake compiled kernel."""
    monkeypatch.setenv("TRTC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-default"))
    art = tmp_path / "art"
    shutil.copytree(tiny_artifacts["tiny-llama"], art)
    (art / "tuning").mkdir()
    kernels = tmp_path / "k"
    (kernels / "ABC").mkdir(parents=True)
    (kernels / "ABC" / "kernel.cubin").write_bytes(b"\x7fELF fake cubin")
    json_name, tar_name = tuning_files("sm90")
    pack(kernels, art / tar_name)
    choices = Tuning(pdl=False, gemv_max_tokens=4)
    (art / json_name).write_text(json.dumps({"choices": choices.to_json()}))
    m = read_manifest(art)
    for name in (json_name, tar_name):
        m.files[name] = file_record(art / name)
    m.tuning = {
        "sm90": TuningRecord(
            device=HERE.device,
            triton=HERE.triton,
            torch=HERE.torch,
            cuda=HERE.cuda,
            created="2026-12-05T00:00:00+00:00",
            file=json_name,
            kernels=tar_name,
        )
    }
    write_manifest(art, m)
    yield art
    try:
        import triton

        triton.knobs.cache.dir = None  # load_tuning set it for the process
    except AttributeError:
        pass


def test_matching_tuning_installs_its_kernels_for_triton(tuned, caplog):
    import torch

    tuning = load_tuning(Artifact.open(tuned), torch.device("cpu"), HERE)
    assert tuning == Tuning(pdl=False, gemv_max_tokens=4)
    sha = read_manifest(tuned).files[tuning_files("sm90")[1]].sha256
    cache = kernel_cache(sha)
    assert (cache / "ABC" / "kernel.cubin").read_bytes() == b"\x7fELF fake cubin"
    assert os.environ["TRITON_CACHE_DIR"] == str(cache)
    # A second replica finds them unpacked.
    assert load_tuning(Artifact.open(tuned), torch.device("cpu"), HERE) == tuning


@pytest.mark.parametrize(
    "here, why",
    [
        (KernelEnvironment("sm80", "NVIDIA A100", "3.6.0", "2.11.0", "13.0"), "tuned for sm90"),
        (
            KernelEnvironment("sm90", HERE.device, "3.5.1", "2.11.0", "13.0"),
            "Triton 3.6.0 (here 3.5.1)",
        ),
        (
            KernelEnvironment("sm90", HERE.device, "3.6.0", "2.10.0", "13.0"),
            "torch 2.11.0 (here 2.10.0)",
        ),
        (
            KernelEnvironment("sm90", HERE.device, "3.6.0", "2.11.0", "12.8"),
            "CUDA 13.0 (here 12.8)",
        ),
    ],
)
def test_another_gpu_or_version_is_refused_with_a_warning(tuned, caplog, here, why):
    import torch

    with caplog.at_level(logging.WARNING, logger="trtc.tuning"):
        assert load_tuning(Artifact.open(tuned), torch.device("cpu"), here) is None
    assert why in caplog.text and "compiled at start" in caplog.text
    assert os.environ["TRITON_CACHE_DIR"].endswith("triton-default")  # left alone


def test_damaged_kernels_are_refused_with_a_warning(tuned, caplog):
    import torch

    tar_name = tuning_files("sm90")[1]
    data = bytearray((tuned / tar_name).read_bytes())
    data[700] ^= 0xFF
    (tuned / tar_name).write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="trtc.tuning"):
        assert load_tuning(Artifact.open(tuned), torch.device("cpu"), HERE) is None
    assert "sha256" in caplog.text and "compiled at start" in caplog.text


def test_untuned_artifact_loads_nothing(tiny_artifacts, caplog):
    import torch

    with caplog.at_level(logging.INFO, logger="trtc.tuning"):
        assert (
            load_tuning(Artifact.open(tiny_artifacts["tiny-llama"]), torch.device("cpu"), HERE)
            is None
        )
    assert "not tuned" in caplog.text


def test_archive_is_the_same_for_the_same_kernels(tmp_path):
    src = tmp_path / "k"
    (src / "B").mkdir(parents=True)
    (src / "A.json").write_text("{}")
    (src / "B" / "x.cubin").write_bytes(b"1234")
    pack(src, tmp_path / "one.tar")
    os.utime(src / "A.json", (1, 1))
    pack(src, tmp_path / "two.tar")
    assert (tmp_path / "one.tar").read_bytes() == (tmp_path / "two.tar").read_bytes()
    with tarfile.open(tmp_path / "one.tar") as tar:
        assert tar.getnames() == ["A.json", "B/x.cubin"]


def test_unpacked_kernels_are_found_by_tritons_cache(tmp_path, monkeypatch):
    """Triton finds a cached kernel through a group file that lists its files by absolute path:
    the archive must not keep the tune's (temporary) paths, and unpacking must list the files
    where they land, or every shipped kernel is compiled again at start."""
    import triton
    from triton.runtime.cache import FileCacheManager

    monkeypatch.setenv("TRTC_CACHE_DIR", str(tmp_path / "cache"))
    tune_cache = tmp_path / "trtc-tune-xyz" / "triton"
    triton.knobs.cache.dir = str(tune_cache)
    try:
        made = FileCacheManager("KEY")
        files = {
            name: made.put(b"compiled " + name.encode(), name) for name in ("k.cubin", "k.json")
        }
        made.put_group("k.json", files)
        assert made.get_group("k.json") == files  # as Triton looks a compiled kernel up
        pack(tune_cache, tmp_path / "kernels.tar")
        shutil.rmtree(tmp_path / "trtc-tune-xyz")  # the tune's cache is a temporary directory
        assert str(tmp_path).encode() not in (tmp_path / "kernels.tar").read_bytes()

        target = install_kernels(tmp_path / "kernels.tar", "ab" * 32)
        assert triton.knobs.cache.dir == str(target)
        group = FileCacheManager("KEY").get_group("k.json")
        assert group is not None, "Triton would compile the shipped kernel again"
        assert {name: Path(path).read_bytes() for name, path in group.items()} == {
            "k.cubin": b"compiled k.cubin",
            "k.json": b"compiled k.json",
        }
        assert all(Path(path).parent == target / "KEY" for path in group.values())
    finally:
        triton.knobs.cache.dir = None


def test_an_archive_of_no_kernels_unpacks_to_an_empty_cache(tmp_path, monkeypatch):
    """An archive with no kernels (nothing was compiled into it) still installs: Triton then
    compiles into an empty cache of its own, instead of the load failing on a missing folder."""
    import triton

    monkeypatch.setenv("TRTC_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    pack(tmp_path / "empty", tmp_path / "kernels.tar")
    try:
        target = install_kernels(tmp_path / "kernels.tar", "cd" * 32)
        assert target.is_dir() and not any(target.iterdir())
        assert triton.knobs.cache.dir == str(target)
    finally:
        triton.knobs.cache.dir = None
