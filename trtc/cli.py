"""The `trtc` command."""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console

from trtc.errors import TrtcError
from trtc.runtime.executors import EXECUTORS  # light: no torch at import

app = typer.Typer(
    name="trtc",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Compile Hugging Face decoder LLMs (Llama, Mistral, Qwen2) into optimized, "
    "plugin-bearing ONNX/TensorRT artifacts, inspect them, and serve them with in-flight "
    "batching over a paged KV cache.",
)
err = Console(stderr=True, highlight=False)


def _fail(e: Exception) -> None:
    err.print(f"[bold red]error:[/] {e}", markup=True, soft_wrap=True)
    raise typer.Exit(getattr(e, "exit_code", 1))


_interrupted = False  # set by the first SIGINT/SIGTERM of a command that writes atomically


def _interrupt(signum, frame):
    """Ctrl-C and SIGTERM: remembered (`_was_interrupted`: a finaliser running when the signal
    arrives swallows the exception, and the build must still stop) and raised."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _was_interrupted() -> bool:
    return _interrupted


@contextmanager
def _all_or_nothing():
    """For commands that write a directory atomically: SIGTERM ends them as Ctrl-C does (so the
    staging directory is removed), a TrtcError is one line, an interrupt says nothing was
    written."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        yield
    except TrtcError as e:
        _fail(e)
    except KeyboardInterrupt:
        err.print("interrupted: nothing was written")
        raise typer.Exit(130) from None


@app.command()
def build(
    config: Path = typer.Argument(..., help="build config (YAML); see README 'Build config'"),
    output: str | None = typer.Option(
        None, "--output", "-o", help="artifact directory (overrides the config's `output`)"
    ),
    force: bool = typer.Option(
        False, "--force", help="replace an existing artifact at the output path"
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output"),
    tune_after: bool = typer.Option(
        False,
        "--tune",
        help="then run `trtc tune` on the result (this machine's GPU: ship its compiled "
        "kernels and kernel choices in the artifact)",
    ),
):
    """Compile a model: load -> export to ONNX -> graph passes -> artifact.

    The artifact (manifest.json, model.onnx + model.onnx.data, tokenizer/, build.log) appears
    at the output path only when the whole build succeeded."""
    from trtc.compiler.config import load_config

    if tune_after:
        import torch

        if not torch.cuda.is_available():
            _fail(
                ValueError(
                    "--tune compiles and times kernels on this machine's GPU, and it has none; "
                    "build without --tune here, then run `trtc tune ARTIFACT` on the target GPU"
                )
            )
    with _all_or_nothing():
        cfg = load_config(config)  # fast: a bad config fails before torch is imported
        from trtc.compiler.build import build as run_build
        from trtc.compiler.progress import Progress

        progress = Progress(quiet=quiet, interrupted=_was_interrupted)
        out = run_build(cfg, output=output, force=force, progress=progress)
    if not quiet:
        err.print(f"artifact: {out}   (inspect it with: trtc inspect {out})")
    if tune_after:
        # Its own process: Triton must start from an empty cache for the archive to hold only
        # this model's kernels (a build may have compiled others).
        import subprocess
        import sys

        raise typer.Exit(subprocess.call([sys.executable, "-m", "trtc", "tune", str(out)]))


@app.command()
def tune(
    artifact: Path = typer.Argument(..., help="artifact directory written by `trtc build`"),
):
    """Tune an artifact for this machine's GPU, as a build farm's last step: time the kernel
    variants the CUDA executor chooses between (programmatic dependent launch, GEMV or cuBLAS
    for small decode batches) at the model's shapes, compile every kernel serving launches, and
    store both under tuning/<arch> in the artifact (hashed in the manifest). `trtc serve` on the
    same GPU architecture, Triton, torch and CUDA then compiles and times nothing at start;
    anywhere else it warns and compiles as before. Run it again after upgrading them."""
    import logging

    from trtc.runtime.tune import tune_artifact

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        tune_artifact(artifact, log=err.print)
    except TrtcError as e:
        _fail(e)


@app.command()
def inspect(
    artifact: Path = typer.Argument(..., help="artifact directory written by `trtc build`"),
    json_out: bool = typer.Option(False, "--json", help="print the manifest as JSON"),
    no_verify: bool = typer.Option(
        False, "--no-verify", help="skip checking file sizes and hashes"
    ),
):
    """Show what an artifact holds: model, precision, fusions, plugin nodes, KV-cache geometry,
    weight bytes and engines."""
    from trtc.compiler.inspect import inspect_artifact

    try:
        if json_out:
            from trtc.artifact import Artifact

            opened = Artifact.open(artifact)
            if not no_verify:
                opened.verify()
            print(opened.manifest.to_json(), end="")
        else:
            inspect_artifact(artifact, Console(), verify=not no_verify)
    except TrtcError as e:
        _fail(e)


def _engine_config(
    *,
    executor: str,
    kv_cache_memory_mib: float,
    no_prefix_caching: bool,
    no_async_scheduling: bool,
    speculative: str | None,
    speculative_tokens: int,
    speculative_max_batch: int,
    num_blocks: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    defer_graphs: bool = False,
):
    """The `EngineConfig` of the options `serve` and `bench` share (the KV pool in MiB, the
    switches that turn a default off)."""
    from trtc.runtime.engine import EngineConfig

    return EngineConfig(
        executor=executor,
        num_blocks=num_blocks,
        kv_cache_memory=int(kv_cache_memory_mib * 2**20),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=not no_prefix_caching,
        async_scheduling=False if no_async_scheduling else None,
        speculative=speculative,
        speculative_tokens=speculative_tokens,
        speculative_max_batch=speculative_max_batch,
        defer_graphs=defer_graphs,
    )


SPECULATIVE = typer.Option(
    None,
    "--speculative",
    help="speculative decoding: 'ngram' (propose what followed the latest n-gram in the "
    "sequence) or 'draft:DIR' (a smaller trtc artifact with the same tokenizer drafts); the "
    "target verifies the drafts in one step, keeping its output distribution exactly",
)
SPECULATIVE_TOKENS = typer.Option(
    4, "--speculative-tokens", min=1, help="drafts verified per sequence and step, at most"
)
SPECULATIVE_MAX_BATCH = typer.Option(
    8,
    "--speculative-max-batch",
    min=0,
    help="speculate only while at most this many sequences run (beyond, verification costs "
    "more than it saves)",
)


ASYNC_HELP = (
    "wait for each step's tokens before queuing the next (by default the cuda executor queues "
    "a decode step before the previous one's tokens are read, so host work overlaps the GPU)"
)


EXECUTOR_HELP = (
    "auto: an engine of the artifact this host can run (tensorrt), else cuda on a GPU, else "
    "torch (the compiled graph on CPU); naming one forces it, and fails if this host cannot run it"
)
Executor = Enum("Executor", {name: name for name in EXECUTORS}, type=str)


def _torchrun_worker(artifact: Path, executor) -> bool:
    """Under torchrun, ranks above 0 of a tensor-parallel artifact run the driver's steps
    (and return True when it stops); rank 0 goes on to serve."""
    from trtc.runtime.distributed import torchrun_worker

    try:
        return torchrun_worker(str(artifact), executor.value)
    except TrtcError as e:
        _fail(e)


@app.command()
def serve(
    artifact: Path = typer.Argument(..., help="artifact directory written by `trtc build`"),
    host: str = typer.Option(
        "127.0.0.1", help="address to bind (0.0.0.0 exposes the server to the network)"
    ),
    port: int = typer.Option(8000, help="TCP port"),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 endpoints (default: $TRTC_API_KEY)",
    ),
    executor: Executor = typer.Option(Executor.auto, help=EXECUTOR_HELP),
    num_blocks: int | None = typer.Option(
        None, help="KV-cache blocks in the pool (default: from --kv-cache-memory)"
    ),
    kv_cache_memory: float = typer.Option(1024, "--kv-cache-memory", help="MiB for the KV pool"),
    max_num_seqs: int | None = typer.Option(
        None, help="sequences per step (default: the artifact's limit)"
    ),
    max_num_batched_tokens: int | None = typer.Option(
        None, help="tokens per step (default: the artifact's limit)"
    ),
    max_pending: int = typer.Option(256, help="requests in flight before new ones get 429"),
    no_prefix_caching: bool = typer.Option(
        False, "--no-prefix-caching", help="do not reuse KV blocks of shared prompt prefixes"
    ),
    no_async_scheduling: bool = typer.Option(False, "--no-async-scheduling", help=ASYNC_HELP),
    speculative: str | None = SPECULATIVE,
    speculative_tokens: int = SPECULATIVE_TOKENS,
    speculative_max_batch: int = SPECULATIVE_MAX_BATCH,
):
    """Serve an artifact over an OpenAI-compatible HTTP API: /v1/completions,
    /v1/chat/completions (SSE streaming with "stream": true), /v1/models, /health, /metrics.
    SIGTERM or Ctrl-C stops accepting connections and lets running requests finish.
    The engine steps in a process of its own, beside the HTTP server's
    (TRTC_ENGINE_PROCESS=0: on a thread of the server's process)."""
    import logging

    from trtc import envs
    from trtc.runtime.engine.engine_process import LOG_FORMAT, EngineProcess, EngineProcessError

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if _torchrun_worker(artifact, executor):
        return
    config = _engine_config(
        executor=executor.value,
        num_blocks=num_blocks,
        kv_cache_memory_mib=kv_cache_memory,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        no_prefix_caching=no_prefix_caching,
        no_async_scheduling=no_async_scheduling,
        speculative=speculative,
        speculative_tokens=speculative_tokens,
        speculative_max_batch=speculative_max_batch,
        defer_graphs=True,  # ready sooner: the engine loop captures most graphs after
    )
    try:
        if envs.TRTC_ENGINE_PROCESS:
            # The engine loads in its own process while this one imports the server.
            engine = EngineProcess(artifact, config)
            from trtc.runtime.serving.server import serve as run_server

            engine.wait_ready()
        else:
            from trtc.runtime.engine import LLMEngine
            from trtc.runtime.serving.server import serve as run_server

            engine = LLMEngine(artifact, config)
    except (TrtcError, ValueError) as e:  # the engine could not start: say why, in a line
        _fail(e)
    try:
        run_server(engine, host, port, api_key or envs.TRTC_API_KEY, max_pending)
    except EngineProcessError as e:  # its process died while serving
        _fail(e)


@app.command()
def generate(
    artifact: Path = typer.Argument(..., help="artifact directory written by `trtc build`"),
    prompt: str = typer.Argument(..., help="the prompt"),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="tokens to generate at most"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, help="nucleus sampling mass"),
    top_k: int = typer.Option(0, help="0 = off"),
    seed: int | None = typer.Option(None, help="seed for reproducible sampling"),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the model's chat template"),
    executor: Executor = typer.Option(Executor.auto, help=EXECUTOR_HELP),
    speculative: str | None = SPECULATIVE,
    speculative_tokens: int = SPECULATIVE_TOKENS,
):
    """Generate one completion and stream it to the terminal."""
    from trtc.runtime.engine import EngineConfig, LLMEngine, RequestError, SamplingParams

    if _torchrun_worker(artifact, executor):
        return
    try:
        engine = LLMEngine(
            artifact,
            EngineConfig(
                executor=executor.value,
                kv_cache_memory=256 << 20,
                max_num_seqs=1,
                speculative=speculative,
                speculative_tokens=speculative_tokens,
            ),
        )
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
        if chat:
            engine.add_request(
                None,
                params,
                prompt_ids=engine.apply_chat_template([{"role": "user", "content": prompt}]),
            )
        else:
            engine.add_request(prompt, params)
    except (TrtcError, RequestError, ValueError) as e:
        _fail(e)
    out = None
    try:
        while engine.has_unfinished():
            for out in engine.step():
                print(out.delta_text, end="", flush=True)
    finally:
        engine.close()
    print()
    if out is not None:
        gained = engine.counters.mean_accepted_length
        accepted = f", {gained:.2f} tokens per verifying step" if gained is not None else ""
        err.print(f"[{len(out.token_ids)} tokens, finish reason: {out.finish_reason}{accepted}]")


@app.command("eval")
def evaluate(
    artifact: Path = typer.Argument(..., help="artifact directory written by `trtc build`"),
    text: Path = typer.Option(..., "--text", help="text file to measure perplexity on"),
    window: int = typer.Option(512, help="tokens per evaluation window"),
    max_windows: int | None = typer.Option(None, help="evaluate only the first N windows"),
    bos: bool = typer.Option(
        True,
        help="open each window with the tokenizer's BOS token (not scored), "
        "as a served prompt opens; --no-bos scores the bare text",
    ),
    executor: Executor = typer.Option(Executor.auto, help=EXECUTOR_HELP),
):
    """Perplexity of an artifact on a text file, computed on the compiled graph by the runtime's
    executor: compare a quantized artifact with its unquantized source. The text is cut into
    windows scored as fresh sequences."""
    from trtc.runtime.evaluate import perplexity

    if not text.is_file():
        raise typer.BadParameter(f"{text} does not exist", param_hint="--text")
    try:
        r = perplexity(artifact, text.read_text(), window, max_windows, executor.value, bos)
    except (TrtcError, ValueError) as e:
        _fail(e)
    opening = ", each opened by BOS" if r["bos"] else ""
    print(
        f"perplexity {r['perplexity']:.4f} over {r['tokens']} tokens "
        f"({r['windows']} windows of {r['window']}{opening})"
    )


def _range(text: str, name: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
        if not 1 <= lo <= hi:
            raise ValueError
        return lo, hi
    except ValueError:
        raise typer.BadParameter(
            f"{text!r}: expected MIN:MAX with 1 <= MIN <= MAX (or one number)", param_hint=name
        ) from None


# `trtc bench`'s options, declared here so that the command's signature stays short.
BENCH_ARTIFACT = typer.Argument(None, help="artifact to load in-process (or use --url)")
BENCH_URL = typer.Option(None, help="benchmark a running `trtc serve` at this URL instead")
NUM_REQUESTS = typer.Option(64, "--num-requests", "-n", help="requests in the set")
PROMPT_LEN = typer.Option("32:256", help="prompt tokens, MIN:MAX (uniform)")
OUTPUT_LEN = typer.Option("16:128", help="output tokens, MIN:MAX (uniform; EOS ignored)")
BENCH_SEED = typer.Option(0, help="seed of the request set and of Poisson arrivals")
BENCH_TEXT = typer.Option(
    None,
    help="cut the prompts from real text instead of random tokens: 'pydoc' (the Python "
    "documentation's topics, which every Python ships) or a UTF-8 file; with --url, give "
    "the served ARTIFACT too (its tokenizer cuts the same prompts)",
)
CONCURRENCY = typer.Option(
    16, help="requests in flight (in-flight mode) / batch size (static mode)"
)
RATE = typer.Option(None, help="Poisson arrival rate in requests/s instead of fixed concurrency")
BENCH_MODE = typer.Option(
    "both", help="inflight | static | both (same request set, one after the other)"
)
BASELINE = typer.Option(
    None,
    help="hf: also run transformers' generate on the source model in static batches of "
    "--concurrency, on the same device; hf-cb: transformers' continuous batching "
    "(ContinuousBatchingManager) with at most --concurrency in flight; hf,hf-cb: both",
)
JSON_OUT = typer.Option(None, "--json", help="also write the results as JSON here")
PREFIX_CACHING = typer.Option(
    False,
    "--prefix-caching",
    help="keep prefix caching on (off by default: "
    "the second mode would reuse the first mode's blocks)",
)
BENCH_API_KEY = typer.Option(
    None, "--api-key", help="API key of the server at --url (default: $TRTC_API_KEY)"
)
LOAD_PROCESSES = typer.Option(
    0,
    "--load-processes",
    help="with --url: processes the load generator spreads its streams over (0: one per 16 "
    "streams, at most 4 and half the CPUs); one process parsing every stream's chunks can "
    "be the bottleneck it measures",
    min=0,
)


@app.command()
def bench(
    artifact: Path | None = BENCH_ARTIFACT,
    url: str | None = BENCH_URL,
    num_requests: int = NUM_REQUESTS,
    prompt_len: str = PROMPT_LEN,
    output_len: str = OUTPUT_LEN,
    seed: int = BENCH_SEED,
    text: str | None = BENCH_TEXT,
    concurrency: int = CONCURRENCY,
    rate: float | None = RATE,
    mode: str = BENCH_MODE,
    baseline: str | None = BASELINE,
    executor: Executor = typer.Option(Executor.auto, help=EXECUTOR_HELP),
    kv_cache_memory: float = typer.Option(1024, "--kv-cache-memory", help="MiB for the KV pool"),
    json_out: Path | None = JSON_OUT,
    prefix_caching: bool = PREFIX_CACHING,
    api_key: str | None = BENCH_API_KEY,
    load_processes: int = LOAD_PROCESSES,
    no_async_scheduling: bool = typer.Option(False, "--no-async-scheduling", help=ASYNC_HELP),
    speculative: str | None = SPECULATIVE,
    speculative_tokens: int = SPECULATIVE_TOKENS,
    speculative_max_batch: int = SPECULATIVE_MAX_BATCH,
):
    """Replay a request set and report TTFT, TPOT, inter-token and end-to-end latency
    (mean/p50/p90/p99), requests/s, output tokens/s and memory, for in-flight batching and for
    static batching (fixed batches that wait for their longest member) on the same requests."""
    import json

    from trtc.runtime.bench import report

    baselines = _bench_baselines(artifact, url, text, baseline, mode)
    plen, olen = _range(prompt_len, "--prompt-len"), _range(output_len, "--output-len")
    spec = {"n": num_requests, "prompt_len": plen, "output_len": olen, "seed": seed}
    try:
        if text is not None:
            from trtc.corpus import read_text

            spec["text"] = read_text(text)
        if url:
            results = _bench_server(url, artifact, spec, concurrency, rate, api_key, load_processes)
        else:
            config = _engine_config(
                executor=executor.value,
                kv_cache_memory_mib=kv_cache_memory,
                max_num_seqs=max(concurrency, 1),
                no_prefix_caching=not prefix_caching,
                no_async_scheduling=no_async_scheduling,
                speculative=speculative,
                speculative_tokens=speculative_tokens,
                speculative_max_batch=speculative_max_batch,
            )
            results = _bench_in_process(artifact, config, spec, concurrency, rate, mode, baselines)
    except (TrtcError, ValueError) as e:
        _fail(e)
    _print_bench(results, report.title(num_requests, prompt_len, output_len, seed, text))
    if json_out:
        document = report.json_document(
            results, num_requests, prompt_len, output_len, seed, concurrency
        )
        json_out.write_text(json.dumps(document, indent=2))


def _bench_baselines(
    artifact: Path | None, url: str | None, text: str | None, baseline: str | None, mode: str
) -> tuple[str, ...]:
    """`bench`'s arguments checked together; the baselines named by ``--baseline``."""
    if (artifact is None and url is None) or (artifact and url and text is None):
        raise typer.BadParameter(
            "give either an ARTIFACT directory or --url (both only with --text: the ARTIFACT's "
            "tokenizer then cuts the prompts)",
            param_hint="ARTIFACT/--url",
        )
    baselines = tuple(baseline.split(",")) if baseline else ()
    if not set(baselines) <= {"hf", "hf-cb"}:
        raise typer.BadParameter(
            f"{baseline!r}: choose hf, hf-cb or hf,hf-cb", param_hint="--baseline"
        )
    if mode not in ("inflight", "static", "both"):
        raise typer.BadParameter(f"{mode!r}: choose inflight, static or both", param_hint="--mode")
    return baselines


def _bench_server(
    url: str,
    artifact: Path | None,
    spec: dict,
    concurrency: int,
    rate: float | None,
    api_key: str | None,
    load_processes: int,
) -> list[dict]:
    """`bench --url`: the server replayed, its prompts cut by the ARTIFACT's tokenizer when
    one is given."""
    from trtc import envs
    from trtc.runtime.bench import bench_url, default_load_processes

    tokenizer = None
    if artifact is not None:
        from trtc.artifact import Artifact
        from trtc.runtime.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(Artifact.open(artifact).tokenizer_dir)
    processes = load_processes or default_load_processes(concurrency)
    return bench_url(
        url, spec, concurrency, rate, api_key or envs.TRTC_API_KEY, tokenizer, processes
    )


def _bench_in_process(
    artifact: Path,
    config,
    spec: dict,
    concurrency: int,
    rate: float | None,
    mode: str,
    baselines: tuple[str, ...],
) -> list[dict]:
    """`bench ARTIFACT`: the artifact in-process in ``mode`` ("both": each of the modes), then
    the baselines on its source model (loaded by the compiler)."""
    from trtc.runtime.bench import MODES, bench_artifact

    hf_loader = None
    if baselines:
        from trtc.compiler.source import load_source_model as hf_loader
    modes = list(MODES) if mode == "both" else [mode]
    return bench_artifact(
        artifact,
        config,
        spec,
        concurrency,
        rate,
        modes,
        hf_loader,
        log=err.print,
        baselines=baselines,
    )


def _print_bench(results: list[dict], title: str) -> None:
    """The results as a table (a column per result), then the first compared with the others."""
    from rich.table import Table

    from trtc.runtime.bench import report

    table = Table(title=title)
    table.add_column("metric")
    for r in results:
        table.add_column(r["mode"], justify="right")
    for row in report.table_rows(results):
        table.add_row(*row)
    Console().print(table)
    for line in report.comparisons(results):
        Console().print(line)


def _checkpoint_names() -> str:
    from trtc.compiler.random_checkpoint import checkpoint_names  # light: no torch at import

    return " | ".join(checkpoint_names())


@app.command()
def checkpoint(
    name: str = typer.Argument(..., help=f"geometry: {_checkpoint_names()}"),
    output: Path = typer.Option(
        ..., "--output", "-o", help="checkpoint directory to create (a `model: {source: hf}` path)"
    ),
    dtype: str = typer.Option("bf16", help="bf16 | fp16 | fp32: the stored weights' dtype"),
    seed: int = typer.Option(
        0, help="seed of the weights: the same seed writes the same bytes, in any shard size"
    ),
    shard_size: str = typer.Option(
        "5GB",
        "--shard-size",
        help="most bytes per safetensors file (5GB, 500MB, 2GiB or a byte count); "
        "a larger tensor gets a file of its own",
    ),
    force: bool = typer.Option(
        False, "--force", help="replace an existing checkpoint at the output path"
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output"),
):
    """Write a Hugging Face checkpoint with random weights at a named geometry, for benchmarks
    and tests: config.json, generation_config.json, a byte-level tokenizer and sharded
    safetensors with an index, as transformers' save_pretrained writes them.

    Tensors are generated and written one at a time, so memory stays small whatever the model
    (llama-3-8b: 16 GB in bf16). The directory appears at the output path only when complete."""
    from trtc.compiler.random_checkpoint import format_size, parse_size, write_random_checkpoint

    try:
        shard_bytes = parse_size(shard_size)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--shard-size") from None

    def shard_done(s) -> None:
        if not quiet:
            err.print(
                f"{s.filename}: {s.tensors} tensors, {format_size(s.bytes)} in {s.seconds:.1f}s "
                f"({s.index}/{s.count})",
                soft_wrap=True,
            )

    with _all_or_nothing():
        r = write_random_checkpoint(
            name, output, dtype, seed, shard_bytes, progress=shard_done, force=force
        )
    if not quiet:
        err.print(
            f"checkpoint: {r.path}   ({len(r.files)} files, {format_size(r.bytes)}, "
            f"{r.parameters:,} parameters in {dtype}, {r.seconds:.1f}s)",
            soft_wrap=True,
        )


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
