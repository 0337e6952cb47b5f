"""`trtc tune ARTIFACT`: make an artifact ready to serve on this GPU without compiling or timing
anything at start, as TensorRT's engines are (docs/architecture.md, "Tuning").

On the target GPU (in the build farm), with a fresh Triton cache:
1. time the variants the CUDA executor chooses between at the model's shapes: programmatic
   dependent launch on or off, and up to which batch the decode projections take the GEMV
   instead of cuBLAS (decode steps replayed from their CUDA graphs, median of many);
2. with the winners set, run a workload that meets the shapes serving meets (one short
   request alone, then prompts of 1 to 1024 tokens and outputs of 1 to 64 at the artifact's
   batch limit: prefill, mixed and decode steps of every captured size), scheduled as a
   server schedules it, then with every step waiting for its inputs, then with every step
   eager, so Triton compiles each kernel the server will launch;
3. write ``tuning/<arch>.json`` (choices, timings, versions) and ``tuning/<arch>.kernels.tar``
   (that Triton cache), then record both in the manifest with their sha256.
Each file appears whole (written under a temporary name, then renamed) and the manifest is
replaced last. A tune stopped between those renames leaves files whose hashes the manifest
refuses: a server then warns and compiles at start, as for an untuned artifact, until the next
tune."""

from __future__ import annotations

import datetime
import io
import json
import os
import statistics
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from trtc.artifact import (
    Artifact,
    FileRecord,
    TuningRecord,
    file_record,
    read_manifest,
    write_manifest,
)
from trtc.contract import SequenceWork, make_step
from trtc.errors import ArtifactError
from trtc.runtime.bench.in_process import run_engine
from trtc.runtime.bench.request_sets import make_requests
from trtc.runtime.executors.tuning import (
    KernelEnvironment,
    Tuning,
    is_group_file,
    portable_group,
    tuning_files,
    use_triton_cache,
)

DECODE_CONTEXT = 512  # cached tokens per sequence in the timed decode steps
GEMV_CANDIDATES = (1, 2, 4, 8)  # decode batches where the GEMV may beat cuBLAS


def time_decode(executor, batch: int, context: int = DECODE_CONTEXT, iters: int = 50) -> float:
    """Median seconds of one decode step of ``batch`` sequences (its CUDA graph replayed)."""
    bs = executor.block_size
    # Within the model's context (the graphs' block tables) and the pool.
    context = min(context, executor.max_blocks_per_seq * bs - 1)
    context = min(context, (executor.num_blocks // batch) * bs - 1)
    per_seq = -(-(context + 1) // bs)
    work = [
        SequenceWork([i + 1], context, list(range(i * per_seq, (i + 1) * per_seq)))
        for i in range(batch)
    ]
    step = make_step(work, bs)
    for _ in range(5):
        executor.execute(step)
    torch.cuda.synchronize(executor.device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        executor.execute(step)
        torch.cuda.synchronize(executor.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def choose(executor, log: Callable[[str], None]) -> tuple[Tuning, dict]:
    """Time the variants on ``executor`` (a CudaExecutor) and return the winners with the
    timings behind them (microseconds)."""
    from trtc.plugins.kernels import gemv, pdl

    sizes = executor.graph_sizes
    wide = max(b for b in sizes if b <= 64)
    timings: dict = {"decode_context": DECODE_CONTEXT}

    def decode_us(batch: int) -> float:
        return 1e6 * time_decode(executor, batch)

    # Programmatic dependent launch: on or off (a captured graph keeps what it was captured
    # with, so each setting gets its own capture).
    pdl_us = {}
    for on in (True, False):
        pdl.set_enabled(on)
        executor.capture_graphs(mixed=False)
        pdl_us[on] = {1: decode_us(1), wide: decode_us(wide)}
    use_pdl = sum(pdl_us[True].values()) <= sum(pdl_us[False].values())
    timings["pdl"] = {str(on).lower(): us for on, us in pdl_us.items()}
    pdl.set_enabled(use_pdl)
    log(
        f"programmatic dependent launch {'on' if use_pdl else 'off'}: decode step at batch 1 "
        f"{pdl_us[True][1]:.0f} vs {pdl_us[False][1]:.0f} us (on vs off), at {wide} "
        f"{pdl_us[True][wide]:.0f} vs {pdl_us[False][wide]:.0f} us"
    )
    # The GEMV against cuBLAS, batch by batch: it serves every batch up to the last one it wins.
    gemv_us = {}
    for batch in (b for b in GEMV_CANDIDATES if b in sizes):
        row = {}
        for name, setting in (("gemv", batch), ("cublas", 0)):
            gemv.set_max_tokens(setting)
            executor.capture_graphs(mixed=False)
            row[name] = decode_us(batch)
        gemv_us[batch] = row
    threshold = 0
    for batch, row in gemv_us.items():
        if row["gemv"] >= row["cublas"]:
            break
        threshold = batch
    timings["gemv_vs_cublas"] = {str(b): row for b, row in gemv_us.items()}
    gemv.set_max_tokens(threshold)
    log(
        "decode projections: GEMV up to "
        + (f"{threshold} tokens" if threshold else "no batch (cuBLAS always)")
        + " ("
        + ", ".join(
            f"batch {b}: {r['gemv']:.0f} vs {r['cublas']:.0f} us" for b, r in gemv_us.items()
        )
        + ", GEMV vs cuBLAS)"
    )
    start = time.perf_counter()
    executor.capture_graphs()  # with the winners
    timings["graph_capture_s"] = time.perf_counter() - start
    return Tuning(pdl=use_pdl, gemv_max_tokens=threshold), timings


def cover(engine, log: Callable[[str], None]) -> dict:
    """Run the shapes serving meets, so each kernel the server launches is compiled now."""
    limits = engine.manifest.limits
    vocab = engine.manifest.model.vocab_size
    special = set(engine.tokenizer.all_special_ids)
    longest = max(2, min(1024, limits.max_seq_len // 2))
    batch = engine.scheduler.max_num_seqs
    started = time.perf_counter()
    # A server's own warm-up steps, now with the chosen settings (`choose` ran them with the
    # defaults; programmatic dependent launch is a compile-time flag of the kernels).
    engine.executor.warm_up()
    alone = make_requests(1, (8, 8), (8, 8), vocab, 1, special)
    mixed = make_requests(min(2 * batch, 256), (1, longest), (1, 64), vocab, 2, special)
    # As a server schedules them (a step queued ahead of the previous one's tokens, with the
    # requests that wait admitted into it), then with every step waiting for the previous
    # one's tokens (`--no-async-scheduling`, and the steps a server does not queue ahead):
    # the two take different graphs for some steps (a short multi-token step is replayed
    # from its own graph only when its input ids come from the host).
    serving = engine.async_scheduling
    for async_steps in dict.fromkeys((serving, False)):
        engine.async_scheduling = async_steps
        run_engine(engine, alone, "inflight", 1)
        run_engine(engine, mixed, "inflight", batch)
    engine.async_scheduling = serving
    # The same shapes again with every step eager: what a server runs before its graphs are
    # captured (they come after it is ready), and for steps beyond them. Eager launches of
    # some shapes use kernel variants the graphs' do not (Triton specializes on sizes).
    with engine.executor.graphs_set_aside():
        run_engine(engine, mixed, "inflight", batch)
    seconds = time.perf_counter() - started
    log(
        f"ran the serving shapes (prompts 1-{longest} tokens, up to {batch} in flight), "
        "from the graphs and eagerly"
    )
    return {"coverage_s": seconds, "coverage_longest_prompt": longest, "coverage_batch": batch}


def pack(cache: Path, out: Path) -> int:
    """``cache`` (a Triton cache directory) as a tar at ``out``, entries sorted and times zeroed
    (the same kernels make the same archive), each kernel's group file listing its files
    relative to the cache (`portable_group`: ``cache`` is gone once the tune ends); returns the
    number of kernel files."""
    count = 0
    with tarfile.open(out, "w") as tar:
        for path in sorted(cache.rglob("*")):
            if not path.is_file():
                continue
            info = tar.gettarinfo(str(path), str(path.relative_to(cache)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            data = path.read_bytes()
            if is_group_file(path):  # lists the kernel's files by their paths in `cache`
                data = portable_group(data)
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            count += path.suffix == ".cubin"
    return count


def tune_artifact(directory: str | Path, log: Callable[[str], None] = print) -> dict:
    """Tune ``directory`` for this GPU (see the module's docstring); returns the record."""
    from trtc.runtime.engine import EngineConfig, LLMEngine

    directory = Path(directory)
    if not torch.cuda.is_available():
        raise ArtifactError(
            "trtc tune times and compiles kernels on the GPU it tunes for: run it on a machine "
            "with that GPU (this one has no CUDA device)"
        )
    artifact = Artifact.open(directory)
    if artifact.manifest.parallel.tensor > 1:
        raise ArtifactError(
            f"{directory} is split over {artifact.manifest.parallel.tensor} tensor-parallel "
            "ranks; tuning covers one-GPU artifacts only so far"
        )
    if not os.access(directory, os.W_OK):
        raise ArtifactError(f"{directory} is not writable: trtc tune adds tuning/ to the artifact")
    device = torch.device("cuda")
    here = KernelEnvironment.current(device)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trtc-tune-") as tmp:
        cache = Path(tmp) / "triton"
        cache.mkdir()
        use_triton_cache(cache)  # only what this tune compiles lands in the archive
        log(f"tuning {directory} for {here.arch} ({here.device}), Triton {here.triton}")
        engine = LLMEngine(
            artifact,  # steps scheduled as served; nothing of an earlier tuning loaded
            EngineConfig(executor="cuda", enable_prefix_caching=False, use_tuning=False),
        )
        try:
            tuning, timings = choose(engine.executor, log)
            timings.update(cover(engine, log))
        finally:
            engine.close()
        json_name, tar_name = tuning_files(here.arch)
        try:
            (directory / "tuning").mkdir(exist_ok=True)
        except OSError as e:
            raise ArtifactError(f"cannot write the tuning into {directory}: {e}") from None
        record = {
            "arch": here.arch,
            "environment": asdict(here),
            "choices": tuning.to_json(),
            "timings": timings,
            "tune_s": time.perf_counter() - started,
        }
        written = _write_files(directory, json_name, tar_name, record, cache)
    manifest = read_manifest(directory)  # as it is now: nothing else of it changes
    manifest.files = {**manifest.files, **written}
    manifest.tuning = {
        **manifest.tuning,
        here.arch: TuningRecord(
            device=here.device,
            triton=here.triton,
            torch=here.torch,
            cuda=here.cuda,
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            file=json_name,
            kernels=tar_name,
        ),
    }
    write_manifest(directory, manifest)
    kernels = record["kernels"]
    log(
        f"tuned for {here.arch}: {kernels['files']} compiled kernels "
        f"({kernels['bytes'] / 2**20:.1f} MiB) in {tar_name}, choices in {json_name} "
        f"({record['tune_s']:.0f} s)"
    )
    return record


def _write_files(
    directory: Path, json_name: str, tar_name: str, record: dict, cache: Path
) -> dict[str, FileRecord]:
    """The archive and the choices, each under a temporary name until whole."""
    tar_tmp = directory / f"{tar_name}.tmp"
    json_tmp = directory / f"{json_name}.tmp"
    try:
        files = pack(cache, tar_tmp)
        record["kernels"] = {"files": files, "bytes": tar_tmp.stat().st_size}
        json_tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tar_tmp, directory / tar_name)
        os.replace(json_tmp, directory / json_name)
    finally:
        for tmp in (tar_tmp, json_tmp):
            tmp.unlink(missing_ok=True)
    return {name: file_record(directory / name) for name in (json_name, tar_name)}
