"""The artifact on disk: reproducible, atomic, versioned."""

from __future__ import annotations

import json

import pytest

from conftest import build_quiet
from trtc.artifact import Artifact, read_manifest
from trtc.compiler import writer
from trtc.compiler.config import parse_config
from trtc.errors import ArtifactError

VOLATILE = ("created",)


def test_same_config_builds_identical_artifact(tmp_path):
    cfg = parse_config({"model": {"source": "tiny", "name": "tiny-mistral"}, "precision": "fp16"})
    a = build_quiet(cfg, tmp_path / "a")
    b = build_quiet(cfg, tmp_path / "b")
    assert (a / "model.onnx").read_bytes() == (b / "model.onnx").read_bytes()
    assert (a / "model.onnx.data").read_bytes() == (b / "model.onnx.data").read_bytes()
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    for m in (ma, mb):
        for key in VOLATILE:
            m.pop(key)
        m["build"].pop("duration_s")
        m["build"].pop("memory")  # measured, like the duration
    assert ma == mb


def test_manifest_records_what_the_issue_asks(tiny_artifacts):
    artifact = Artifact.open(tiny_artifacts["tiny-llama"])
    m = artifact.manifest
    assert m.format == "trtc-artifact" and m.format_version == 1
    on_disk = json.loads((artifact.path / "manifest.json").read_text())
    for key in (
        "model",
        "precision",
        "kv_cache",
        "io",
        "plugins",
        "fusions",
        "source",
        "trtc_version",
        "engines",
        "files",
        "tokenizer",
    ):
        assert key in on_disk
    assert m.engines == []
    assert len(m.source["sha256"]) == 64
    assert m.tokenizer.chat_template is True
    assert set(m.files) >= {"model.onnx", "model.onnx.data", "tokenizer/tokenizer.json"}
    artifact.verify()


def test_failure_mid_build_leaves_nothing(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(writer, "save_onnx", broken)
    cfg = parse_config({"model": {"source": "tiny", "name": "tiny-llama"}})
    with pytest.raises(RuntimeError, match="disk full"):
        build_quiet(cfg, tmp_path / "nested" / "out")
    assert list(tmp_path.iterdir()) == []


def test_too_new_or_foreign_manifest_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text(
        json.dumps({"format": "trtc-artifact", "format_version": 99})
    )
    with pytest.raises(ArtifactError, match="newer than this trtc reads"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ArtifactError, match="not a trtc manifest"):
        read_manifest(tmp_path)


def test_malformed_manifest_names_the_field(tiny_artifacts, tmp_path):
    """A manifest of the right format and version whose content does not fit the typed model is
    refused once, at open, naming the field (not a KeyError deep in an executor)."""
    manifest = json.loads((tiny_artifacts["tiny-llama"] / "manifest.json").read_text())
    del manifest["kv_cache"]["block_size"]
    manifest["limits"]["max_seq_len"] = "long"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"malformed manifest at 'limits\.max_seq_len'"):
        Artifact.open(tmp_path)


def test_manifest_round_trips(tiny_artifacts):
    """What `trtc build` wrote is what the typed manifest writes again (one definition)."""
    path = tiny_artifacts["tiny-llama"] / "manifest.json"
    assert Artifact.open(path.parent).manifest.to_json() == path.read_text()


def test_truncated_file_is_detected(tiny_artifacts, tmp_path):
    import shutil

    art = tmp_path / "copy"
    shutil.copytree(tiny_artifacts["tiny-llama"], art)
    data = art / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(ArtifactError, match="truncated"):
        Artifact.open(art).verify()


def test_file_digest_hashes_the_whole_and_each_chunk(monkeypatch):
    import hashlib
    import random

    from trtc import artifact

    monkeypatch.setattr(artifact, "CHUNK_BYTES", 1000)
    data = random.Random(0).randbytes(3500)
    digest = artifact.FileDigest()
    for start, stop in ((0, 7), (7, 1000), (1000, 2999), (2999, 3500)):  # pieces across chunks
        digest.update(data[start:stop])
    record = digest.record()
    assert record.bytes == 3500 and record.sha256 == hashlib.sha256(data).hexdigest()
    assert record.chunks == [
        hashlib.sha256(data[i : i + 1000]).hexdigest() for i in range(0, 3500, 1000)
    ]
    small = artifact.FileDigest()
    small.update(data[:1000])  # one chunk or less: the whole-file hash says it all
    assert small.record().chunks is None


def test_chunked_weights_are_checked_chunk_by_chunk(tiny_artifacts, tmp_path, monkeypatch):
    import shutil

    from trtc import artifact

    monkeypatch.setattr(artifact, "CHUNK_BYTES", 1 << 14)
    art = tmp_path / "copy"
    shutil.copytree(tiny_artifacts["tiny-llama"], art)
    m = read_manifest(art)
    data = art / "model.onnx.data"
    m.files["model.onnx.data"] = artifact.file_record(data)
    count = len(m.files["model.onnx.data"].chunks)
    assert count > 4
    artifact.write_manifest(art, m)
    Artifact.open(art).verify()

    raw = bytearray(data.read_bytes())
    raw[5 * (1 << 14) + 3] ^= 1  # one bit in the sixth chunk
    data.write_bytes(bytes(raw))
    with pytest.raises(
        ArtifactError, match=rf"modified in 1 of {count} chunks, from byte offset {5 << 14}"
    ):
        Artifact.open(art).verify()

    m.files["model.onnx.data"].chunks = m.files["model.onnx.data"].chunks[:-1]
    artifact.write_manifest(art, m)
    with pytest.raises(ArtifactError, match="chunk hashes"):
        Artifact.open(art).verify()
