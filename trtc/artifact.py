"""The artifact format: what `trtc build` writes and every other command reads.

An artifact is a directory with a versioned ``manifest.json`` (typed below: `Manifest`) and the
files it records (graph, weights, tokenizer, engines), each with its size and sha256.
`Artifact.open` reads and checks the manifest once; the object is passed down to whoever needs
the files, and `Artifact.verify` hashes each file at most once, when it is first loaded.
The graph and weights are written by the compiler (`trtc.compiler.writer`); `trtc tune` adds
per-architecture kernels (``tuning/``). Both replace the manifest through `write_manifest`.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trtc.errors import ArtifactError

FORMAT = "trtc-artifact"
# The newest format this code reads. 2: tensor-parallel artifacts (rank{i}/ graphs); a
# one-graph artifact is still written as 1, which every version reads.
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"
BUILD_LOG = "build.log"


# A file larger than this also records the sha256 of each CHUNK_BYTES piece: checking it then
# takes one core per piece instead of one core for the whole file (an 8B model's 16 GB of
# weights: about 10 s on one core, under 1 s on 16).
CHUNK_BYTES = 1 << 27
_READ_BYTES = 1 << 23  # hashlib releases the GIL on buffers this large


def sha256_file(path: Path) -> str:
    return _sha256_range(path, 0, os.path.getsize(path))


class FileDigest:
    """The sha256 of a byte stream and of each `CHUNK_BYTES` piece of it, fed in order: a file
    is hashed once, as it is written, into the `FileRecord` the manifest keeps."""

    def __init__(self):
        self.whole = hashlib.sha256()
        self.size = 0
        self._chunks: list[str] = []
        self._chunk = hashlib.sha256()

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        self.whole.update(view)
        while len(view):
            take = min(len(view), CHUNK_BYTES - self.size % CHUNK_BYTES)
            self._chunk.update(view[:take])
            self.size += take
            view = view[take:]
            if self.size % CHUNK_BYTES == 0:
                self._chunks.append(self._chunk.hexdigest())
                self._chunk = hashlib.sha256()

    def record(self) -> FileRecord:
        chunks = None
        if self.size > CHUNK_BYTES:
            last = [self._chunk.hexdigest()] if self.size % CHUNK_BYTES else []
            chunks = self._chunks + last
        return FileRecord(bytes=self.size, sha256=self.whole.hexdigest(), chunks=chunks)


def file_record(path: Path) -> FileRecord:
    """Size, sha256 and chunk hashes of a file on disk."""
    digest = FileDigest()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(_READ_BYTES), b""):
            digest.update(piece)
    return digest.record()


def _sha256_range(path: Path, start: int, length: int) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        end = start + length
        while start < end and (piece := os.pread(fd, min(_READ_BYTES, end - start), start)):
            h.update(piece)
            start += len(piece)
    finally:
        os.close(fd)
    return h.hexdigest()


def damaged_chunks(path: Path, record: FileRecord) -> list[int]:
    """The `CHUNK_BYTES` pieces of ``path`` that differ from ``record.chunks``, hashed on up to
    16 threads (pread and hashlib release the GIL, and parallel reads also keep a cold disk's
    queue full)."""
    count = len(record.chunks)
    workers = max(1, min(count, os.cpu_count() or 1, 16))
    with ThreadPoolExecutor(workers, thread_name_prefix="trtc-verify") as pool:
        found = pool.map(lambda i: _sha256_range(path, i * CHUNK_BYTES, CHUNK_BYTES), range(count))
        return [i for i, (got, want) in enumerate(zip(found, record.chunks)) if got != want]


class _Section(BaseModel):
    """A manifest section: the fields the format defines, typed and required. Keys a newer
    build of the same format version adds are kept (and written back) but not required."""

    model_config = ConfigDict(extra="allow")


def _omit_none(value: Any) -> bool:
    return value is None


class ModelGeometry(_Section):
    """The decoder's shape, read from the source model's config."""

    model_config = ConfigDict(extra="allow", frozen=True)

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_parameters: dict[str, Any]
    sliding_windows: tuple[int, ...]  # per layer; 0 = full attention
    # Qwen3: RMSNorm over each head of q and k before the rotary embedding. Defaults to False so
    # manifests written before the field load as what they are.
    qk_norm: bool = False


class Limits(_Section):
    max_num_tokens: int  # tokens in one step
    max_num_seqs: int  # sequences in one step
    max_seq_len: int  # context length


class KVCacheLayout(_Section):
    layout: str  # "paged"
    block_size: int
    dtype: str  # fp32 | fp16 | bf16 | fp8
    num_layers: int
    num_kv_heads: int
    head_dim: int
    pool_shape: list[str | int]
    bytes_per_token: int
    bytes_per_block: int
    scales: dict[str, Any] | None = Field(None, exclude_if=_omit_none)  # fp8: per-layer K/V


class TensorRecord(_Section):
    name: str
    dtype: str
    shape: list[str | int]
    doc: str = ""


class StepIO(_Section):
    """The step contract as this artifact's graph takes it (`trtc.contract.io_manifest`)."""

    inputs: list[TensorRecord]
    outputs: list[TensorRecord]
    aliases: dict[str, str]  # output -> the input it updates in place
    kv_pool: dict[str, Any]


class QuantizationRecord(_Section):
    """How the weights were quantized: ``method`` and the record of its stage (the runtime
    reads the three properties below; the rest is shown by `trtc inspect`)."""

    method: str  # none | rtn | awq | gptq | fp8

    def _get(self, key: str) -> Any:
        return (self.model_extra or {}).get(key)

    @property
    def bits(self) -> int | None:
        return self._get("bits")

    @property
    def group_size(self) -> int | None:
        return self._get("group_size")

    @property
    def linear_weight_bytes_quantized(self) -> int | None:
        """Packed weights plus scales and zero points of every quantized Linear."""
        return self._get("linear_weight_bytes_quantized")


class GraphRecord(_Section):
    file: str
    weights_file: str
    opset: dict[str, int]
    functions: list[str]
    num_nodes: int
    op_counts: dict[str, int]
    weight_bytes: dict[str, int]  # "total" and per kind (linear, embedding, ...)


class TokenizerRecord(_Section):
    dir: str
    chat_template: bool
    eos_token_id: int | None
    bos_token_id: int | None


class EngineRecord(_Section):
    """One built TensorRT or TensorRT-RTX plan (fields in the order the backends write them)."""

    target: str  # sm86, ...
    compute_capability: str  # "8.6"
    backend: str  # tensorrt | tensorrt-rtx
    trt_version: str
    precision: str
    kv_layout: str  # paged | slot
    hardware_compatibility: str | None = Field(None, exclude_if=_omit_none)  # tensorrt only
    file: str
    bytes: int
    sha256: str
    build_time_s: float
    profile: dict[str, dict[str, list[int]]]  # input -> min/opt/max shape
    io: dict[str, Any]  # the built network's inputs and outputs
    aliases: dict[str, str]  # updated cache output -> its input
    contract: dict[str, Any] | None = Field(None, exclude_if=_omit_none)  # slot engines


class ParallelLayout(_Section):
    """How the model is split over tensor-parallel ranks (absent or ``tensor: 1``: one graph).

    Rank ``i``'s graph and weights are ``rank{i}/model.onnx`` and ``rank{i}/model.onnx.data``;
    the manifest's ``kv_cache``, ``io`` and ``graph`` sections describe one rank's graph (the
    ranks' graphs have the same nodes and shapes, their weights differ)."""

    tensor: int = 1
    # Per rank: the query heads, KV heads and intermediate columns it holds, [start, stop).
    ranks: list[dict[str, list[int]]] = []
    column_parallel: list[str] = []  # projections split by output features
    row_parallel: list[str] = []  # split by input features, summed by trtc::AllReduce
    replicated: list[str] = []  # what every rank holds whole
    kv_heads_replicated: bool = False  # more ranks than KV heads: ranks share KV heads


def rank_file(name: str, rank: int, ranks: int) -> str:
    """Where rank ``rank``'s ``name`` (`MODEL_FILE`, `WEIGHTS_FILE`) lives in an artifact of
    ``ranks`` tensor-parallel ranks, relative to it: ``rank{i}/name``, or ``name`` for one."""
    return name if ranks == 1 else f"rank{rank}/{name}"


class TuningRecord(_Section):
    """`trtc tune` on one GPU architecture: where its choices and compiled kernels are (both
    listed with their sha256 under ``files``), and what they were made with; a server on
    another GPU, Triton, torch or CUDA version ignores them (and compiles at start)."""

    device: str  # the GPU it was tuned on, e.g. "NVIDIA H100 80GB HBM3"
    triton: str
    torch: str
    cuda: str | None
    created: str
    file: str  # tuning/<arch>.json: the choices and the timings behind them
    kernels: str  # tuning/<arch>.kernels.tar: Triton's compiled kernels for these shapes


class FileRecord(_Section):
    bytes: int
    sha256: str
    # sha256 of each CHUNK_BYTES piece, for files larger than one (`FileDigest`); a reader
    # checks these (in parallel) instead of the whole-file hash when they are present.
    chunks: list[str] | None = Field(None, exclude_if=_omit_none)


class Manifest(BaseModel):
    """``manifest.json``: everything about an artifact that is not its tensors."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    trtc_version: str
    name: str
    created: str
    source: dict[str, Any]
    model: ModelGeometry
    precision: str  # fp32 | fp16 | bf16: weights and activations
    limits: Limits
    kv_cache: KVCacheLayout
    quantization: QuantizationRecord
    io: StepIO
    plugins: list[dict[str, Any]]
    fusions: dict[str, Any]
    graph: GraphRecord
    tokenizer: TokenizerRecord
    build: dict[str, Any]
    parallel: ParallelLayout = Field(
        default_factory=ParallelLayout, exclude_if=lambda p: p.tensor == 1
    )
    engines: list[EngineRecord] = []
    # `trtc tune`: by architecture name (sm90, ...); absent until an artifact is tuned.
    tuning: dict[str, TuningRecord] = Field(default_factory=dict, exclude_if=lambda t: not t)
    files: dict[str, FileRecord] = {}

    def rank_file(self, name: str, rank: int = 0) -> str:
        """``name`` of rank ``rank``'s graph in this artifact (`rank_file`)."""
        if not 0 <= rank < self.parallel.tensor:
            raise ArtifactError(
                f"rank {rank} of a {self.parallel.tensor}-rank artifact (ranks are 0 to "
                f"{self.parallel.tensor - 1})"
            )
        return rank_file(name, rank, self.parallel.tensor)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"


def write_manifest(directory: str | Path, manifest: Manifest) -> None:
    """Replace ``manifest.json`` atomically: a reader sees the old one or the new one whole."""
    path = Path(directory) / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, path)


def read_manifest(directory: str | Path) -> Manifest:
    """The manifest of ``directory``, refused with a reason if it is missing, foreign, too new
    or malformed."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{directory} is not a trtc artifact (no {MANIFEST})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ArtifactError(f"{path}: not a trtc manifest (format {found!r})")
    version = data.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: format version {version} is newer than this trtc reads "
            f"({FORMAT_VERSION}); upgrade trtc"
        )
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ArtifactError(
            f"{path}: malformed manifest at '{where}': {first['msg']} "
            f"({e.error_count()} problem(s); rebuild the artifact with this trtc)"
        ) from None


class Artifact:
    """An opened artifact: its directory and typed manifest, checked once and passed down."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path = path
        self.manifest = manifest
        self._verified: set[str] = set()

    @classmethod
    def open(cls, path: str | Path) -> Artifact:
        """Read the manifest; the files' hashes are checked by `verify` as they are loaded."""
        path = Path(path)
        return cls(path, read_manifest(path))

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / self.manifest.tokenizer.dir

    def verify(self, names: list[str] | None = None) -> None:
        """Check the recorded size and sha256 of the named files (default: all), each once; a
        file with chunk hashes is checked chunk by chunk, in parallel."""
        for name, rec in self.manifest.files.items():
            if (names is not None and name not in names) or name in self._verified:
                continue
            path = self.path / name
            if not path.is_file():
                raise ArtifactError(f"{self.path}: {name} is missing")
            size = path.stat().st_size
            if size != rec.bytes:
                raise ArtifactError(
                    f"{self.path}: {name} has {size} bytes, the manifest records {rec.bytes} "
                    f"(truncated or replaced)"
                )
            if rec.chunks is not None:
                if len(rec.chunks) != -(-rec.bytes // CHUNK_BYTES):
                    raise ArtifactError(
                        f"{self.path}: the manifest records {len(rec.chunks)} chunk hashes for "
                        f"{name} ({rec.bytes} bytes in {CHUNK_BYTES} byte chunks): rebuild the "
                        "artifact with this trtc"
                    )
                damaged = damaged_chunks(path, rec)
                if damaged:
                    where = ", ".join(f"{i * CHUNK_BYTES}" for i in damaged[:4])
                    raise ArtifactError(
                        f"{self.path}: {name} does not match its recorded sha256 (modified in "
                        f"{len(damaged)} of {len(rec.chunks)} chunks, from byte offset {where})"
                    )
            elif sha256_file(path) != rec.sha256:
                raise ArtifactError(
                    f"{self.path}: {name} does not match its recorded sha256 (modified)"
                )
            self._verified.add(name)

    def __repr__(self) -> str:
        return f"Artifact({str(self.path)!r}, {self.manifest.name!r})"
