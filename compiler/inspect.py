"""`trtc inspect`: what an artifact holds, read from its manifest (files checked against it)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from trtc.artifact import Artifact, EngineRecord, Manifest
from trtc.engines import engine_refusal


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _span(bounds: list[int]) -> str:
    return f"{bounds[0]}..{bounds[1] - 1}"


def inspect_artifact(
    directory: str | Path, console: Console | None = None, verify: bool = True
) -> Manifest:
    """Print an artifact's summary (model, limits, KV cache, weights, fusions, plugins,
    engines and whether this host runs them); returns its manifest."""
    console = console or Console()
    artifact = Artifact.open(directory)
    if verify:
        artifact.verify()
    m = artifact.manifest
    console.print(
        f"[bold]{m.name}[/]  ({directory})  trtc {m.trtc_version}, "
        f"format v{m.format_version}, built {m.created}"
    )
    console.print(_overview(m))
    console.print(_fusions(m))
    console.print(_plugins(m))
    _print_tuning(console, m)
    _print_engines(console, m)
    return m


def _overview(m: Manifest) -> Table:
    """One row per fact: model, source, precision, limits, KV cache, tensor-parallel layout,
    weights, graph and build."""
    g, kv, graph = m.model, m.kv_cache, m.graph
    overview = Table(show_header=False, box=None, pad_edge=False)
    overview.add_row(
        "model",
        f"{g.architecture}: {g.num_layers} layers, hidden {g.hidden_size}, "
        f"{g.num_heads} heads / {g.num_kv_heads} KV heads x {g.head_dim}, "
        f"vocab {g.vocab_size}",
    )
    overview.add_row(
        "source", f"{m.source['kind']} {m.source['path']} (sha256 {m.source['sha256'][:12]})"
    )
    overview.add_row("precision", f"{m.precision}; quantization {m.quantization.method}")
    lim = m.limits
    overview.add_row(
        "limits",
        f"{lim.max_num_tokens} tokens/step, {lim.max_num_seqs} sequences, "
        f"context {lim.max_seq_len}",
    )
    per_rank = " per rank" if m.parallel.tensor > 1 else ""
    overview.add_row(
        "KV cache",
        f"{kv.layout}, block {kv.block_size} tokens, {kv.dtype}, pool "
        f"{kv.pool_shape}{per_rank}; {kv.bytes_per_token:,} bytes/token, "
        f"{kv.bytes_per_block:,} bytes/block{per_rank}",
    )
    if m.parallel.tensor > 1:
        _add_parallel_rows(overview, m)
    wb = graph.weight_bytes
    overview.add_row(
        "weights" + per_rank,
        f"{_mb(wb['total'])} ("
        + ", ".join(f"{k} {_mb(v)}" for k, v in wb.items() if k != "total")
        + ")",
    )
    overview.add_row("graph", f"{graph.file}: {graph.num_nodes} nodes, opsets {graph.opset}")
    build = m.build or {}
    if "duration_s" in build:
        memory = build.get("memory") or {}
        peak = memory.get("peak_rss_bytes")
        overview.add_row(
            "build",
            f"{build['duration_s']} s"
            + (f", peak resident memory {peak / 1e9:.2f} GB" if peak else ""),
        )
    return overview


def _add_parallel_rows(overview: Table, m: Manifest) -> None:
    """How the tensor-parallel ranks split the model, and each rank's share."""
    p = m.parallel
    overview.add_row(
        "parallel",
        f"tensor {p.tensor} (rank{{i}}/model.onnx): column-parallel "
        f"{', '.join(p.column_parallel)}; row-parallel {', '.join(p.row_parallel)} + "
        f"AllReduce; replicated {', '.join(p.replicated)}"
        + ("; KV heads replicated" if p.kv_heads_replicated else ""),
    )
    for rank, shard in enumerate(p.ranks):
        overview.add_row(
            "",
            f"rank {rank}: query heads {_span(shard['heads'])}, KV heads "
            f"{_span(shard['kv_heads'])}, intermediate {_span(shard['intermediate'])}",
        )


def _fusions(m: Manifest) -> Table:
    """Each fusion kind: how many the passes made, per layer and after the last layer."""
    fusions = Table(title="fusions", title_justify="left")
    fusions.add_column("kind")
    fusions.add_column("total", justify="right")
    fusions.add_column("per layer", justify="right")
    fusions.add_column("final", justify="right")
    report = m.fusions
    for kind, total in report["totals"].items():
        per = sorted({c.get(kind, 0) for c in report["per_layer"].values()})
        fusions.add_row(
            kind, str(total), "/".join(map(str, per)), str(report["final"].get(kind, ""))
        )
    return fusions


def _plugins(m: Manifest) -> Table:
    """The custom ops the graph uses: version, node count, outputs written in place."""
    plugins = Table(title="plugins", title_justify="left")
    for col in ("op", "version", "nodes", "in-place outputs"):
        plugins.add_column(col)
    for p in m.plugins:
        plugins.add_row(
            f"{p['domain']}::{p['op_type']}",
            str(p["version"]),
            str(p["num_nodes"]),
            ", ".join(f"{o}->{i}" for o, i in p["aliases"].items()),
        )
    return plugins


def _print_engines(console: Console, m: Manifest) -> None:
    """The engines the artifact holds, and whether this host runs each."""
    if not m.engines:
        console.print("engines: none (ONNX artifact only)")
        return
    table = Table(title="engines", title_justify="left")
    for col in ("target", "backend", "KV layout", "size", "sha256", "I/O", "runs on this host"):
        table.add_column(col)
    for e in m.engines:
        ins, outs = e.io["inputs"], e.io["outputs"]
        caches = sum(1 for t in ins if "cache" in t["name"] and t["name"] != "cache_positions")
        shown = [f"{t['name']} {t['shape']} {t['dtype']}" for t in ins if "cache." not in t["name"]]
        io = f"in: {'; '.join(shown)}; + {caches} caches -> {len(outs)} outputs"
        table.add_row(
            f"{e.target} (cc {e.compute_capability})",
            f"{e.backend} {e.trt_version}",
            e.kv_layout,
            _mb(e.bytes),
            e.sha256[:12],
            io,
            host_can_run(e),
        )
    console.print(table)


def _print_tuning(console, m) -> None:
    """The architectures `trtc tune` shipped kernels for, and what they were made with."""
    if not m.tuning:
        console.print("tuned for: none (the CUDA executor compiles its kernels at start)")
        return
    table = Table(title="tuned for (trtc tune)", title_justify="left")
    for col in ("arch", "GPU", "Triton", "torch", "CUDA", "kernels", "created"):
        table.add_column(col)
    for arch, t in sorted(m.tuning.items()):
        kernels = m.files.get(t.kernels)
        table.add_row(
            arch,
            t.device,
            t.triton,
            t.torch,
            t.cuda or "-",
            _mb(kernels.bytes) if kernels else "missing",
            t.created,
        )
    console.print(table)


def host_can_run(engine: EngineRecord) -> str:
    """Whether this machine could deserialize and run the engine, and if not, why (the TensorRT
    executor's own check, `trtc.engines`)."""
    why = engine_refusal(engine)
    return "yes" if why is None else f"no: {why}"
