"""The last stage, write: the artifact directory (format: `trtc.artifact`), built in a hidden
staging directory beside the output and renamed into place at the end, so a failure or Ctrl-C
leaves nothing half-written."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import torch

from trtc.artifact import (
    BUILD_LOG,
    MANIFEST,
    MODEL_FILE,
    WEIGHTS_FILE,
    FileDigest,
    FileRecord,
    file_record,
)
from trtc.compiler.weight_recipes import LazyWeight, weight_id
from trtc.errors import ConfigError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _staging_prefix(output: Path) -> str:
    # Host and pid in the name: a later build can tell a staging directory whose process was
    # killed outright (SIGKILL, a lost machine: no cleanup ran) from one still being filled.
    return f".{output.name}.partial-{socket.gethostname()}-{os.getpid()}-"


def _remove_abandoned(output: Path) -> list[Path]:
    """Staging directories of ``output`` left by builds on this host that no longer run."""
    removed = []
    host_prefix = f".{output.name}.partial-{socket.gethostname()}-"
    for p in output.parent.glob(f".{glob.escape(output.name)}.partial-*"):
        pid = p.name[len(host_prefix) :].split("-", 1)[0]
        if not p.name.startswith(host_prefix) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        except PermissionError:
            pass  # alive, another user's
    return removed


@contextmanager
def staging_dir(
    output: Path,
    force: bool,
    log: Callable[[str], None] | None = None,
    marker: str = MANIFEST,
    what: str = "trtc artifact",
):
    """Yield an empty directory to fill; on success it becomes ``output`` in one rename, on any
    failure (Ctrl-C included) it and any parents made for it are removed. ``force`` replaces an
    existing ``output`` only if it holds ``marker`` (it is a ``what``). Staging directories of
    the same output abandoned by killed builds are removed first."""
    output = output.absolute()
    if output.exists() and not force:
        raise ConfigError(
            f"output: {output} already exists (use --force to replace it, or choose "
            f"another --output)"
        )
    if output.exists() and not (output / marker).is_file():
        raise ConfigError(
            f"output: {output} exists and is not a {what} (no {marker}); refusing to replace "
            "it: choose another --output"
        )
    created = []
    parent = output.parent
    try:
        missing = [p for p in [parent, *parent.parents] if not p.exists()]
        for p in reversed(missing):
            p.mkdir()
            created.append(p)
        for p in _remove_abandoned(output):
            if log is not None:
                log(f"removed {p.name}, left by a build that was killed")
        staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(output), dir=parent))
        staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private; an artifact is shared
    except OSError as e:
        for p in reversed(created):
            shutil.rmtree(p, ignore_errors=True)
        raise ConfigError(f"output: cannot write to {output}: {e.strerror or e}") from None
    old = None
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
        if old is not None and (old / "artifact").exists() and not output.exists():
            os.replace(old / "artifact", output)  # the swap failed half way: put it back
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        for p in reversed(created):
            shutil.rmtree(p, ignore_errors=True)
        raise


# onnx.save_model's rule for what goes to the data file, kept so artifacts are laid out as
# onnx lays them out: ``sys.getsizeof(raw_data) >= 1024``, and getsizeof(bytes) is its length
# plus the bytes object's header.
_EXTERNAL_THRESHOLD = 1024 - sys.getsizeof(b"")


def save_onnx(
    model: onnx.ModelProto,
    directory: Path,
    recipes: Mapping[str, LazyWeight] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, str]:
    """``model.onnx`` with every weight of at least ~1 KB in ``model.onnx.data``, in initializer
    order (the layout ``onnx.save_model(save_as_external_data=True)`` gives).

    Placeholder initializers (`compiler.weights`) are produced from ``recipes`` one at a time
    and written straight to the data file, so host memory holds one weight, not the model.
    Returns the records (size, sha256, chunk hashes) of both files, hashed as they were
    written (`file_records` takes them instead of reading gigabytes back)."""
    recipes = recipes or {}
    initializers = list(model.graph.initializer)
    sizes = (
        recipes[w].nbytes if (w := weight_id(t)) in recipes else len(t.raw_data)
        for t in initializers
    )
    total = sum(n for n in sizes if n >= _EXTERNAL_THRESHOLD)  # what goes to the data file
    last_report = time.monotonic()
    digest = FileDigest()
    with open(directory / WEIGHTS_FILE, "wb") as data:
        for tensor in initializers:
            wid = weight_id(tensor)
            if wid is not None:
                if wid not in recipes:
                    raise RuntimeError(f"weight {tensor.name}: no recipe to produce it")
                value = recipes[wid].materialize()
                raw = value.reshape(-1).view(torch.uint8).numpy()
                del tensor.external_data[:]
                tensor.ClearField("data_location")
                if raw.nbytes < _EXTERNAL_THRESHOLD:
                    tensor.raw_data = raw.tobytes()
                    continue
            elif tensor.HasField("raw_data") and len(tensor.raw_data) >= _EXTERNAL_THRESHOLD:
                raw = np.frombuffer(tensor.raw_data, np.uint8)
            elif tensor.data_location == onnx.TensorProto.EXTERNAL:
                raise RuntimeError(f"initializer {tensor.name}: external data not produced here")
            else:
                continue
            offset = data.tell()
            data.write(memoryview(raw))
            digest.update(memoryview(raw))
            _point_to_data(tensor, offset, raw.nbytes)
            if log is not None and time.monotonic() - last_report > 5:
                log(f"{data.tell() / 1e9:.2f} of {total / 1e9:.2f} GB written")
                last_report = time.monotonic()
    graph_bytes = model.SerializeToString()
    (directory / MODEL_FILE).write_bytes(graph_bytes)
    for name in (MODEL_FILE, WEIGHTS_FILE):
        (directory / name).chmod(0o666 & ~_umask())
    graph_digest = FileDigest()
    graph_digest.update(graph_bytes)
    return {MODEL_FILE: graph_digest.record(), WEIGHTS_FILE: digest.record()}


def _point_to_data(tensor: onnx.TensorProto, offset: int, length: int) -> None:
    """What ``onnx.external_data_helper.set_external_data`` writes (same keys, same order),
    for a tensor whose bytes never were in the proto."""
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", WEIGHTS_FILE), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def file_records(
    directory: Path, known: Mapping[str, FileRecord] | None = None
) -> dict[str, FileRecord]:
    """Size and hashes of every file the manifest vouches for (all but itself and the log);
    ``known`` gives records already computed while writing, by relative path."""
    known = known or {}
    records = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name not in (MANIFEST, BUILD_LOG):
            name = str(p.relative_to(directory))
            records[name] = known.get(name) or file_record(p)
    return records
