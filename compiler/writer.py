"""The last stage, write: the artifact directory (format: `trtc.artifact`), built in a hidden
staging directory beside the output and renamed into place at the end, so a failure or Ctrl-C
leaves nothing half-written."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import onnx

from trtc.artifact import BUILD_LOG, MANIFEST, MODEL_FILE, WEIGHTS_FILE, Manifest, sha256_file
from trtc.errors import ConfigError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def staging_dir(output: Path, force: bool):
    """Yield an empty directory to fill; on success it becomes ``output`` in one rename."""
    output = output.absolute()
    if output.exists() and not force:
        raise ConfigError(
            f"output: {output} already exists (use --force to replace it, or choose "
            f"another --output)"
        )
    if output.exists() and not (output / MANIFEST).is_file():
        raise ConfigError(
            f"output: {output} exists and is not a trtc artifact; refusing to replace it"
        )
    created = []
    parent = output.parent
    try:
        missing = [p for p in [parent, *parent.parents] if not p.exists()]
        for p in reversed(missing):
            p.mkdir()
            created.append(p)
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=parent))
        staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private; an artifact is shared
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
    onnx.save_model(
        model,
        str(directory / MODEL_FILE),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=WEIGHTS_FILE,
        size_threshold=1024,
        convert_attribute=False,
    )
    for name in (MODEL_FILE, WEIGHTS_FILE):
        (directory / name).chmod(0o666 & ~_umask())


def file_records(directory: Path) -> dict[str, dict]:
    """Size and sha256 of every file the manifest vouches for (all but itself and the log)."""
    records = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name not in (MANIFEST, BUILD_LOG):
            records[str(p.relative_to(directory))] = {
                "bytes": p.stat().st_size,
                "sha256": sha256_file(p),
            }
    return records


def write_manifest(directory: Path, manifest: Manifest) -> None:
    (directory / MANIFEST).write_text(manifest.to_json())
