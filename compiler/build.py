"""`trtc build`: config -> load -> export -> passes -> write, one stage at a time."""

from __future__ import annotations

import copy
import platform
import re
import shutil
import time
from collections import Counter
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import onnx
import torch

import trtc
from trtc import contract
from trtc.artifact import BUILD_LOG, MODEL_FILE, WEIGHTS_FILE, Manifest, rank_file, write_manifest
from trtc.compiler import writer
from trtc.compiler.config import BuildConfig
from trtc.compiler.export import export_onnx
from trtc.compiler.families import geometry_from_config
from trtc.compiler.memory import gb
from trtc.compiler.model import step_skeleton
from trtc.compiler.parallel import (
    check_tensor_parallel,
    layout_record,
    rank_geometry,
    rank_shard,
    tensor_slice,
)
from trtc.compiler.passes.pipeline import check_report, fusion_report, run_passes
from trtc.compiler.progress import Progress
from trtc.compiler.source import (
    LoadedSource,
    gguf_parsed_once,
    load_hf_config,
    load_source,
    max_seq_len,
)
from trtc.compiler.weight_recipes import plan_weights
from trtc.errors import BuildError, ConfigError
from trtc.plugins import PLUGINS
from trtc.plugins.spec import DOMAIN

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
# A projection's tensors: fp weight and bias, or the INT4 / FP8 plugin's weights and scales.
LINEAR_TENSOR = re.compile(r"_proj\.(weight|bias|qweight|scales|zeros|weight_scale|input_scale)$")
# Inside the staging directory: calibrated layers' quantized tensors until they are written.
QUANTIZE_SPILL = ".quantize"


def check_buildable(cfg: BuildConfig) -> None:
    """Reject what this version cannot build, before any heavy work."""
    if cfg.backend.name == "tensorrt-rtx":
        from trtc.compiler.backends.tensorrt_rtx import check_targets, import_trt

        try:
            check_targets(cfg.backend.targets, import_trt())
        except BuildError as e:  # not installed: a setup problem, said before any work
            raise ConfigError(f"backend.name: {e}") from None
    if cfg.backend.name == "tensorrt":
        from trtc.compiler.backends.tensorrt_full import check_targets, import_trt

        try:
            import_trt()
        except BuildError as e:  # not installed: a setup problem, said before any work
            raise ConfigError(f"backend.name: {e}") from None
        check_targets(cfg.backend.targets, cfg.backend.hardware_compatibility)


def check_group_size(cfg: BuildConfig, hf_config) -> None:
    """INT4 groups must tile every Linear's input width: say so before loading any weight."""
    if cfg.quantization.method not in ("rtn", "awq", "gptq"):
        return
    gs = cfg.quantization.group_size
    widths = {
        "hidden_size": hf_config.hidden_size,
        "intermediate_size": hf_config.intermediate_size,
        "num_attention_heads * head_dim": hf_config.num_attention_heads
        * (
            getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads
        ),
    }
    bad = {k: v for k, v in widths.items() if v % gs}
    if bad and not cfg.quantization.partial_groups:
        dividing = [str(c) for c in (32, 64, 128) if all(v % c == 0 for v in widths.values())]
        raise ConfigError(
            f"quantization.group_size: {gs} does not divide the model's "
            + ", ".join(f"{k} ({v})" for k, v in bad.items())
            + (f"; choose {' or '.join(dividing)}" if dividing else "")
            + ", or set quantization.partial_groups: true to let the last group of "
            "each row be shorter ("
            + ", ".join(f"{v} % {gs} = {v % gs} columns" for v in sorted(set(bad.values())))
            + ")"
        )
    odd = {k: v for k, v in widths.items() if v % 2}
    if odd:
        raise ConfigError(
            "quantization.method: INT4 packs two input columns a byte, and the model's "
            + ", ".join(f"{k} ({v})" for k, v in odd.items())
            + " is odd; use fp8 or none"
        )


def kv_cache_record(cfg: BuildConfig, g, kv_scales: dict | None = None) -> dict:
    bytes_per_token = 2 * g.num_layers * g.num_kv_heads * g.head_dim * DTYPE_BYTES[cfg.kv_dtype]
    record = {
        "layout": "paged",
        "block_size": cfg.kv_cache.block_size,
        "dtype": cfg.kv_dtype,
        "num_layers": g.num_layers,
        "num_kv_heads": g.num_kv_heads,
        "head_dim": g.head_dim,
        "pool_shape": [
            "layers",
            2,
            "num_blocks",
            cfg.kv_cache.block_size,
            g.num_kv_heads,
            g.head_dim,
        ],
        "bytes_per_token": bytes_per_token,
        "bytes_per_block": bytes_per_token * cfg.kv_cache.block_size,
    }
    if kv_scales is not None:
        record["scales"] = kv_scales
    return record


def graph_record(model: onnx.ModelProto, ranks: int = 1) -> dict:
    """Nodes, opsets and weight bytes of one graph (one rank's, in a tensor-parallel
    artifact: the ranks' graphs have the same nodes and sizes)."""
    ops = Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph.node)
    weight_bytes = Counter()
    for init in model.graph.initializer:
        n = int(torch.tensor(init.dims).prod().item()) if init.dims else 1
        size = n * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        name = init.name
        kind = (
            "embedding"
            if "embed_tokens" in name
            else "lm_head"
            if "lm_head" in name
            else "linear"
            if LINEAR_TENSOR.search(name)
            else "norm"
            if "norm" in name
            else "rope_tables"
            if "rope" in name
            else "constants"
        )
        weight_bytes[kind] += size
    return {
        "file": rank_file(MODEL_FILE, 0, ranks),
        "weights_file": rank_file(WEIGHTS_FILE, 0, ranks),
        "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "functions": [f"{f.domain}::{f.name}" for f in model.functions],
        "num_nodes": len(model.graph.node),
        "op_counts": dict(sorted(ops.items())),
        "weight_bytes": {"total": sum(weight_bytes.values()), **dict(sorted(weight_bytes.items()))},
    }


def plugin_records(model: onnx.ModelProto) -> list[dict]:
    records = []
    for spec in PLUGINS.values():
        nodes = [
            n.name for n in model.graph.node if n.domain == DOMAIN and n.op_type == spec.op_type
        ]
        if nodes:
            records.append({**spec.to_manifest(), "num_nodes": len(nodes)})
    return records


def build_rtx(
    proto: onnx.ModelProto, manifest: Manifest, cfg: BuildConfig, staging: Path, progress: Progress
) -> list[dict]:
    """TensorRT-RTX engines: the paged graph lowered to native layers with a slot KV cache,
    built CPU-only for each target (see compiler/backends)."""
    from trtc.compiler.backends.rtx_lowering import lower_for_rtx, lowering_summary
    from trtc.compiler.backends.tensorrt_rtx import build_rtx_engines
    from trtc.slot_contract import SlotContract

    seq_len = manifest.limits.max_seq_len
    with progress.stage("lower", "lowering plugins to TensorRT-RTX native layers") as done:
        lowered = lower_for_rtx(proto, manifest, seq_len)
        summary = lowering_summary(lowered)
        done["detail"] = ", ".join(
            f"{k} {v}"
            for k, v in sorted(summary["op_counts"].items())
            if k in ("Attention", "TRT_KVCacheUpdate")
        )
    with progress.stage(
        "engines", f"building TensorRT-RTX engines for {', '.join(cfg.backend.targets)}"
    ) as done:
        records = build_rtx_engines(
            lowered, staging, cfg.backend.targets, manifest.limits, cfg.precision, log=progress.log
        )
        done["detail"] = ", ".join(f"{r['target']} {r['bytes'] / 1e6:.0f} MB" for r in records)
    contract = SlotContract.from_manifest(manifest, seq_len).to_manifest()
    for r in records:
        r["contract"] = contract
    return records


def _quantize(cfg: BuildConfig, loaded: LoadedSource, staging: Path, progress: Progress):
    """Quantization and FP8 KV-cache calibration, one decoder layer at a time (see
    compiler/quantize): the quantization result (None for none) and the KV-scales record
    (None unless the KV cache is FP8)."""
    q = cfg.quantization
    kv_fp8 = cfg.kv_dtype == "fp8"
    if q.method == "none" and not kv_fp8:
        return None, None
    from trtc.compiler.quantize.apply import quantize_source

    if q.method == "none":
        name, what = "kv scales", "calibrating the FP8 KV cache"
    else:
        calibrated = q.method != "rtn" or kv_fp8
        name, what = (
            "quantize",
            f"{q.method} ({'calibrating, ' if calibrated else ''}layer by layer)",
        )
    with progress.stage(name, what) as done:
        result = quantize_source(
            loaded.weights,
            loaded.config,
            loaded.tokenizer,
            q.method,
            q.group_size,
            num_samples=q.calibration.num_samples,
            seq_len=q.calibration.seq_len,
            calibration_path=q.calibration.text_file,
            calibration_name=q.calibration.path,
            act_order=q.act_order,
            partial_groups=q.partial_groups,
            kv_cache_scales=kv_fp8,
            device=q.calibration.device,
            spill_dir=staging / QUANTIZE_SPILL,
            log=progress.update,
        )
        details = []
        if q.method != "none":
            rec = result.record()
            details.append(
                f"{rec['num_linears_quantized']} linears, "
                f"{rec['linear_weight_bytes_fp16'] / 1e6:.0f} MB fp16 -> "
                f"{rec['linear_weight_bytes_quantized'] / 1e6:.0f} MB"
            )
        kv_scales = None
        if kv_fp8:
            kv_scales = result.kv_record()
            details.append(
                f"k_scale {min(kv_scales['k']):.3g}..{max(kv_scales['k']):.3g}, "
                f"v_scale {min(kv_scales['v']):.3g}..{max(kv_scales['v']):.3g}"
            )
        done["detail"] = "; ".join(details)
    return (result if q.method != "none" else None), kv_scales


def _check_and_load(cfg: BuildConfig, progress: Progress) -> LoadedSource:
    """The check and load stages: the config read and checked before any weights load. A GGUF
    file's metadata is parsed once for both (`gguf_parsed_once`)."""
    with gguf_parsed_once(cfg.model.source == "gguf"):
        with progress.stage("check", "reading the model config") as done:
            hf_config = load_hf_config(cfg)
            done["detail"] = f"{type(hf_config).__name__.replace('Config', '')}"
        check_group_size(cfg, hf_config)
        check_tensor_parallel(
            cfg.parallel.tensor,
            geometry_from_config(hf_config),
            cfg.quantization.method,
            cfg.quantization.group_size,
        )
        with progress.stage("load", f"opening the {cfg.model.source} checkpoint") as done:
            loaded = load_source(cfg, hf_config)
            g = loaded.geometry
            how = "streamed from disk" if loaded.streamed else "in memory"
            done["detail"] = (
                f"{g.architecture}, {g.num_layers} layers, "
                f"{gb(loaded.weights.nbytes)} of weights ({how})"
            )
    return loaded


def _export(
    cfg: BuildConfig,
    loaded: LoadedSource,
    g_rank,
    seq_len: int,
    quantized,
    kv_scales: dict | None,
    progress: Progress,
) -> tuple[torch.nn.Module, onnx.ModelProto]:
    """The export stage: the step skeleton (one rank's shapes, no weights) and its ONNX
    graph."""
    ranks = cfg.parallel.tensor
    with progress.stage("export", "exporting the step graph to ONNX (torch dynamo)") as done:
        skeleton = step_skeleton(
            loaded.config,
            g_rank,
            seq_len,
            contract.TORCH_DTYPES[cfg.precision],
            quantized,
            None if kv_scales is None else list(zip(kv_scales["k"], kv_scales["v"])),
            world_size=ranks,
        )
        exported = export_onnx(skeleton, cfg.kv_dtype, cfg.kv_cache.block_size)
        done["detail"] = f"{len(exported.graph.node)} nodes" + (
            f", one graph for each of {ranks} ranks" if ranks > 1 else ""
        )
    return skeleton, exported


def _write_rank(
    cfg: BuildConfig,
    loaded: LoadedSource,
    skeleton: torch.nn.Module,
    exported: onnx.ModelProto,
    quantized,
    g_rank,
    rank: int,
    staging: Path,
    progress: Progress,
) -> tuple[onnx.ModelProto, dict, dict[str, str]]:
    """One rank's graph with its own weights (the rank's slice of each tensor): the passes
    run on the exported graph and the result written to the rank's directory. Returns the
    graph (its weights written out, not held), the fusion report and the written files'
    hashes."""
    g, ranks = loaded.geometry, cfg.parallel.tensor
    suffix = f" (rank {rank})" if ranks > 1 else ""
    shard = None
    if ranks > 1:
        shard = partial(
            tensor_slice,
            shard=rank_shard(g, ranks, rank),
            g=g,
            group_size=cfg.quantization.group_size,
        )
    dtype = contract.TORCH_DTYPES[cfg.precision]
    plan = plan_weights(skeleton, loaded.weights, dtype, quantized, shard)
    # Each rank's passes run on a copy of the exported graph; the last rank's on the graph
    # itself, which nothing reads after.
    graph = exported if rank == ranks - 1 else copy.deepcopy(exported)
    proto, results, recipes = run_passes(
        graph,
        g_rank,
        cfg.precision,
        stage=lambda name: progress.stage(f"pass {name}{suffix}", "running"),
        weights=plan,
    )
    del graph, plan
    report = fusion_report(results, g.num_layers)
    problems = check_report(report, g.num_layers)
    if problems:
        raise BuildError("fusion incomplete: " + "; ".join(problems[:4]))
    directory = (staging / rank_file(MODEL_FILE, rank, ranks)).parent
    directory.mkdir(exist_ok=True)
    with progress.stage(f"write{suffix}", "converting and writing the weights") as done:
        digests = writer.save_onnx(proto, directory, recipes, log=progress.update)
        del recipes
        mb = graph_record(proto)["weight_bytes"]["total"] / 1e6
        done["detail"] = f"{mb:.1f} MB of weights"
    return proto, report, {rank_file(n, rank, ranks): d for n, d in digests.items()}


def _manifest(
    cfg: BuildConfig,
    loaded: LoadedSource,
    created: str,
    seq_len: int,
    g_rank,
    quantized,
    kv_scales: dict | None,
    proto: onnx.ModelProto,
    report: dict,
) -> Manifest:
    """The artifact's manifest, all but its engines, files and build duration and memory."""
    g, ranks = loaded.geometry, cfg.parallel.tensor
    return Manifest(
        format_version=2 if ranks > 1 else 1,
        trtc_version=trtc.__version__,
        name=cfg.artifact_name,
        created=created,
        source=loaded.source,
        model=g,
        precision=cfg.precision,
        limits={
            "max_num_tokens": cfg.limits.max_num_tokens,
            "max_num_seqs": cfg.limits.max_num_seqs,
            "max_seq_len": seq_len,
        },
        kv_cache=kv_cache_record(cfg, g_rank, kv_scales),
        quantization=quantized.record() if quantized else {"method": "none"},
        io=contract.io_manifest(
            g.num_layers,
            g_rank.num_kv_heads,
            g.head_dim,
            cfg.kv_cache.block_size,
            cfg.kv_dtype,
            g.vocab_size,
        ),
        plugins=plugin_records(proto),
        fusions=report,
        graph=graph_record(proto, ranks),
        parallel=layout_record(g, ranks),
        tokenizer={
            "dir": "tokenizer",
            "chat_template": bool(getattr(loaded.tokenizer, "chat_template", None)),
            "eos_token_id": loaded.tokenizer.eos_token_id,
            "bos_token_id": loaded.tokenizer.bos_token_id,
        },
        build={
            "config": cfg.model_dump(mode="json"),
            "versions": {
                "torch": torch.__version__,
                "onnx": onnx.__version__,
                "python": platform.python_version(),
            },
        },
    )


def _build_engines(
    cfg: BuildConfig, manifest: Manifest, staging: Path, progress: Progress
) -> list[dict]:
    """The engines of the backend the config names (none for backend none)."""
    if cfg.backend.name == "tensorrt-rtx":
        # The graph and its weights read back from what was written (the written `proto`
        # holds none): TensorRT-RTX builds with the weights in memory.
        written = onnx.load(str(staging / MODEL_FILE))
        return build_rtx(written, manifest, cfg, staging, progress)
    if cfg.backend.name == "tensorrt":
        from trtc.compiler.backends.tensorrt_full import build_tensorrt

        return build_tensorrt(staging, manifest, cfg, progress, cfg.backend.hardware_compatibility)
    return []


def build(
    cfg: BuildConfig,
    output: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Build the artifact ``cfg`` describes into ``output`` (default: the config's), which
    appears only once the whole build has succeeded; returns its directory."""
    progress = progress or Progress()
    check_buildable(cfg)
    out_dir = cfg.output_dir(output)
    started = time.perf_counter()
    created = datetime.now(UTC).isoformat(timespec="seconds")
    with writer.staging_dir(out_dir, force, log=progress.log) as staging:
        progress.log(f"building {cfg.artifact_name} ({cfg.precision}) -> {out_dir}")
        loaded = _check_and_load(cfg, progress)
        seq_len = max_seq_len(cfg, loaded.geometry)
        ranks = cfg.parallel.tensor
        quantized, kv_scales = _quantize(cfg, loaded, staging, progress)
        g_rank = rank_geometry(loaded.geometry, ranks)
        skeleton, exported = _export(cfg, loaded, g_rank, seq_len, quantized, kv_scales, progress)
        # Each rank: the same graph, its own weights.
        hashes: dict[str, str] = {}
        for rank in range(ranks):
            proto, report, digests = _write_rank(
                cfg, loaded, skeleton, exported, quantized, g_rank, rank, staging, progress
            )
            hashes.update(digests)
        del skeleton, exported
        shutil.rmtree(staging / QUANTIZE_SPILL, ignore_errors=True)
        loaded.tokenizer.save_pretrained(str(staging / "tokenizer"))
        manifest = _manifest(
            cfg, loaded, created, seq_len, g_rank, quantized, kv_scales, proto, report
        )
        manifest.engines = _build_engines(cfg, manifest, staging, progress)
        manifest.files = writer.file_records(staging, hashes)
        manifest.build["duration_s"] = round(time.perf_counter() - started, 1)
        manifest.build["memory"] = progress.memory_record()
        write_manifest(staging, manifest)
        progress.log(
            f"built {out_dir} in {time.perf_counter() - started:.1f}s, peak resident memory "
            f"{gb(progress.peak_bytes)} ({gb(loaded.weights.nbytes)} of weights in the checkpoint)"
        )
        (staging / BUILD_LOG).write_text(progress.text())
    return out_dir
