"""Stage 4, write: the artifact directory, built in a hidden staging directory beside the
output and renamed into place at the end, so a failure or Ctrl-C leaves nothing half-written."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import onnx

from trtc.compiler.errors import ArtifactError, ConfigError

FORMAT = "trtc-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def staging_dir(output: Path, force: bool):
    """Yield an empty directory to fill; on success it becomes ``output`` in one rename."""
    output = output.absolute()
    if output.exists() and not force:
        raise ConfigError(f"output: {output} already exists (use --force to replace it, or choose "
                          f"another --output)")
    if output.exists() and not (output / MANIFEST).is_file():
        raise ConfigError(f"output: {output} exists and is not a trtc artifact; refusing to replace it")
    created = []
    parent = output.parent
    try:
        missing = [p for p in [parent, *parent.parents] if not p.exists()]
        for p in reversed(missing):
            p.mkdir()
            created.append(p)
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=parent))
        staging.chmod(0o777 & ~_umask())   # mkdtemp makes it private; an artifact is shared
    except OSError as e:
        for p in reversed(created):
            shutil.rmtree(p, ignore_errors=True)
        raise ConfigError(f"output: cannot write to {output}: {e.strerror or e}") from None
    try:
        yield staging
        if output.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=parent))
            os.replace(output, old / "artifact")
            os.replace(staging, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for p in reversed(created):
            shutil.rmtree(p, ignore_errors=True)
        raise


def save_onnx(model: onnx.ModelProto, directory: Path) -> None:
    """``model.onnx`` with every weight in ``model.onnx.data`` (deterministic layout)."""
    onnx.save_model(model, str(directory / MODEL_FILE), save_as_external_data=True,
                    all_tensors_to_one_file=True, location=WEIGHTS_FILE, size_threshold=1024,
                    convert_attribute=False)
    for name in (MODEL_FILE, WEIGHTS_FILE):
        (directory / name).chmod(0o666 & ~_umask())


def file_records(directory: Path) -> dict[str, dict]:
    records = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name not in (MANIFEST, "build.log"):
            records[str(p.relative_to(directory))] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    return records


def write_manifest(directory: Path, manifest: dict) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def read_manifest(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{directory} is not a trtc artifact (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a trtc manifest (format {manifest.get('format')!r})")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ArtifactError(f"{path}: format version {version} is newer than this trtc reads "
                            f"({FORMAT_VERSION}); upgrade trtc")
    return manifest


def verify_files(directory: str | Path, manifest: dict, names: list[str] | None = None) -> None:
    """Check the recorded size and sha256 of the artifact's files (all, or ``names``)."""
    directory = Path(directory)
    for name, rec in manifest["files"].items():
        if names is not None and name not in names:
            continue
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"{directory}: {name} is missing")
        if path.stat().st_size != rec["bytes"]:
            raise ArtifactError(f"{directory}: {name} has {path.stat().st_size} bytes, the manifest "
                                f"records {rec['bytes']} (truncated or replaced)")
        if sha256_file(path) != rec["sha256"]:
            raise ArtifactError(f"{directory}: {name} does not match its recorded sha256 (modified)")
