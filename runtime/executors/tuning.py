"""A tuned artifact's kernels and choices for this GPU, loaded before anything compiles.

`trtc tune` (runtime/tune.py) runs the CUDA executor on the target GPU, times the variants it
chooses between and packs Triton's compiled kernels for the model's shapes into the artifact:
``tuning/<arch>.json`` (the choices, the timings behind them, the versions) and
``tuning/<arch>.kernels.tar`` (Triton's cache for those kernels), both hashed in the manifest.

At start the CUDA executor asks `load_tuning`: when the artifact has a tuning for this GPU's
architecture, made with this Triton, torch and CUDA, the kernels are unpacked once into the
trtc cache (``$TRTC_CACHE_DIR/kernels/<sha256>``), Triton is pointed at them, and the choices
apply; no kernel is compiled and nothing is timed. Anything else (another architecture or
version, a damaged file) is a warning that says why, and the server compiles at start as an
untuned one does: it still serves."""

from __future__ import annotations

import json
import logging
import os
import tarfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trtc import envs
from trtc.artifact import Artifact, TuningRecord
from trtc.errors import ArtifactError
from trtc.gpu_profiles import arch_name

log = logging.getLogger("trtc.tuning")

TUNING_DIR = "tuning"


def tuning_files(arch: str) -> tuple[str, str]:
    """The choices file and the kernels archive of ``arch``, relative to the artifact."""
    return f"{TUNING_DIR}/{arch}.json", f"{TUNING_DIR}/{arch}.kernels.tar"


@dataclass(frozen=True)
class KernelEnvironment:
    """What compiled kernels depend on besides the model's shapes."""

    arch: str
    device: str
    triton: str
    torch: str
    cuda: str | None

    @classmethod
    def current(cls, device: torch.device) -> KernelEnvironment:
        import triton

        return cls(
            arch=arch_name(torch.cuda.get_device_capability(device)),
            device=torch.cuda.get_device_name(device),
            triton=triton.__version__,
            torch=torch.__version__,
            cuda=torch.version.cuda,
        )


@dataclass
class Tuning:
    """The choices the CUDA executor takes from a tuning (defaults: an untuned executor's)."""

    pdl: bool | None = None  # programmatic dependent launch; None: TRTC_PDL decides
    gemv_max_tokens: int | None = None  # the GEMV/cuBLAS switch; None: TRTC_GEMV_MAX_TOKENS

    def to_json(self) -> dict:
        return asdict(self)


def mismatch(record: TuningRecord, here: KernelEnvironment) -> str | None:
    """Why a tuning made on ``record``'s machine cannot serve here, or None if it can."""
    differs = [
        f"{name} {made} (here {now})"
        for name, made, now in (
            ("Triton", record.triton, here.triton),
            ("torch", record.torch, here.torch),
            ("CUDA", record.cuda, here.cuda),
        )
        if made != now
    ]
    return "made with " + ", ".join(differs) if differs else None


def load_tuning(
    artifact: Artifact, device: torch.device, here: KernelEnvironment | None = None
) -> Tuning | None:
    """The tuning for this GPU (``here``: its environment, read from ``device`` if not given),
    its kernels installed for Triton; None, with the reason in the log, when none fits."""
    tunings = artifact.manifest.tuning
    here = here or KernelEnvironment.current(device)
    record = tunings.get(here.arch)
    if record is None:
        if tunings:
            log.warning(
                "%s is tuned for %s, not for this GPU (%s, %s): kernels are compiled at start; "
                "run `trtc tune %s` on this GPU to ship them",
                artifact.path,
                ", ".join(sorted(tunings)),
                here.device,
                here.arch,
                artifact.path,
            )
        else:
            log.info(
                "%s is not tuned: kernels are compiled at start (`trtc tune` ships them)",
                artifact.path,
            )
        return None
    reason = mismatch(record, here)
    if reason is not None:
        log.warning(
            "ignoring %s's tuning for %s (%s): kernels are compiled at start; tune it again "
            "with this software to ship them",
            artifact.path,
            here.arch,
            reason,
        )
        return None
    try:
        artifact.verify([record.file, record.kernels])
        choices = json.loads(artifact.file(record.file).read_text())["choices"]
        tuning = Tuning(**choices)
        install_kernels(
            artifact.file(record.kernels), artifact.manifest.files[record.kernels].sha256
        )
    except (ArtifactError, OSError, KeyError, TypeError, ValueError, tarfile.TarError) as e:
        log.warning(
            "ignoring %s's tuning for %s: %s; kernels are compiled at start",
            artifact.path,
            here.arch,
            e,
        )
        return None
    log.info("tuned for %s (%s): kernels loaded, no compilation", here.arch, record.device)
    return tuning


def kernel_cache(sha256: str) -> Path:
    """Where a kernels archive is unpacked: one directory per archive content."""
    return envs.cache_dir() / "kernels" / sha256[:32]


# Triton's cache holds a kernel's files in ``<cache>/<key>/`` and finds them through a group
# file, ``<key>/__grp__<name>.json``, that lists them by absolute path: a kernel whose listed
# files are missing is compiled again. The tune's cache is a temporary directory, so the
# archive lists them relative to the cache, and unpacking lists them where they land.
GROUP_PREFIX = "__grp__"


def _key_and_name(path: str) -> str:
    return "/".join(Path(path).parts[-2:])  # "<key>/<file>", wherever the cache was


def _group_with_paths(data: bytes, place: Callable[[str], str]) -> bytes:
    group = json.loads(data)
    children = group.get("child_paths")
    if isinstance(children, dict):
        group["child_paths"] = {name: place(path) for name, path in sorted(children.items())}
    return json.dumps(group, sort_keys=True).encode()


def portable_group(data: bytes) -> bytes:
    """A Triton group file's contents with its files listed as ``<key>/<file>``."""
    return _group_with_paths(data, _key_and_name)


def is_group_file(path: Path) -> bool:
    return path.name.startswith(GROUP_PREFIX) and path.suffix == ".json"


def rebase_groups(directory: Path, final: Path) -> None:
    """List the files of each group in ``directory`` (unpacked there, to be renamed to
    ``final``) by their paths under ``final``. Archives that list absolute paths of the
    machine that tuned them are mended the same way."""
    for path in directory.glob(f"*/{GROUP_PREFIX}*.json"):
        path.write_bytes(
            _group_with_paths(path.read_bytes(), lambda p: str(final / _key_and_name(p)))
        )


def install_kernels(archive: Path, sha256: str) -> Path:
    """Unpack ``archive`` (its ``sha256`` checked by the caller) into the trtc cache once, then
    make it Triton's cache directory for this process."""
    target = kernel_cache(sha256)
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        staging.mkdir(exist_ok=True)  # (an archive of no kernels unpacks to an empty cache)
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")  # no links out, no devices, no absolute paths
        rebase_groups(staging, target)
        try:
            os.replace(staging, target)  # another replica may have unpacked it first: fine
        except OSError:
            if not target.is_dir():
                raise
    use_triton_cache(target)
    return target


def use_triton_cache(directory: Path) -> None:
    """Compiled kernels are looked up (and new ones written) in ``directory`` from now on."""
    os.environ["TRITON_CACHE_DIR"] = str(directory)
    try:
        import triton

        triton.knobs.cache.dir = str(directory)  # Triton >= 3.4 reads its knobs, not the env
    except AttributeError:
        pass


def apply(tuning: Tuning) -> None:
    """Set the process-wide kernel switches a tuning chose, unless the environment sets them
    (an explicit ``TRTC_PDL`` / ``TRTC_GEMV_MAX_TOKENS`` wins)."""
    from trtc.plugins.kernels import gemv, pdl

    if tuning.pdl is not None and "TRTC_PDL" not in os.environ:
        pdl.set_enabled(tuning.pdl)
    if tuning.gemv_max_tokens is not None and "TRTC_GEMV_MAX_TOKENS" not in os.environ:
        gemv.set_max_tokens(tuning.gemv_max_tokens)
