"""The `trtc` command."""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(
    name="trtc", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="Compile Hugging Face decoder LLMs (Llama, Mistral, Qwen2) into optimized, "
         "plugin-bearing ONNX/TensorRT artifacts, and inspect them.")
err = Console(stderr=True, highlight=False)


def _fail(e: Exception) -> None:
    err.print(f"[bold red]error:[/] {e}", markup=True, soft_wrap=True)
    raise typer.Exit(getattr(e, "exit_code", 1))


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt


@app.command()
def build(
    config: Path = typer.Argument(..., help="build config (YAML); see README 'Build config'"),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="artifact directory (overrides the config's `output`)"),
    force: bool = typer.Option(False, "--force", help="replace an existing artifact at the output path"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output"),
):
    """Compile a model: load -> export to ONNX -> graph passes -> artifact.

    The artifact (manifest.json, model.onnx + model.onnx.data, tokenizer/, build.log) appears
    at the output path only when the whole build succeeded."""
    from trtc.compiler.config import load_config
    from trtc.compiler.errors import TrtcError

    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        cfg = load_config(config)          # fast: a bad config fails before torch is imported
        from trtc.compiler.build import build as run_build
        from trtc.compiler.progress import Progress
        out = run_build(cfg, output=output, force=force, progress=Progress(quiet=quiet))
    except TrtcError as e:
        _fail(e)
    except KeyboardInterrupt:
        err.print("interrupted: nothing was written")
        raise typer.Exit(130)
    if not quiet:
        err.print(f"artifact: {out}   (inspect it with: trtc inspect {out})")


@app.command()
def inspect(
    artifact: Path = typer.Argument(..., help="artifact directory written by `trtc build`"),
    json_out: bool = typer.Option(False, "--json", help="print the manifest as JSON"),
    no_verify: bool = typer.Option(False, "--no-verify", help="skip checking file sizes and hashes"),
):
    """Show what an artifact holds: model, precision, fusions, plugin nodes, KV-cache geometry,
    weight bytes and engines."""
    import json

    from trtc.compiler.errors import TrtcError
    from trtc.compiler.inspect import inspect_artifact
    try:
        if json_out:
            from trtc.compiler.artifact import read_manifest, verify_files
            m = read_manifest(artifact)
            if not no_verify:
                verify_files(artifact, m)
            print(json.dumps(m, indent=2))
        else:
            inspect_artifact(artifact, Console(), verify=not no_verify)
    except TrtcError as e:
        _fail(e)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
