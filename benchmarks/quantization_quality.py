"""The quantization quality table: SmolLM2 built from the shipped configs (fp16, INT4 RTN / AWQ /
GPTQ, FP8), each artifact's perplexity measured by `trtc eval`'s code (the runtime's executor on
the compiled graph, plugin nodes included) on held-out texts, against the fp16 artifact.

Two held-out texts, neither of them the calibration text (``pydoc_data.topics``, the language
reference's topics), both installed with the environment (no download):

* ``stdlib-docs``: the documentation pydoc renders for ten standard-library modules (their
  docstrings: English prose about Python, the calibration text's domain, not its text);
* ``torch-readme``: the README of the installed ``torch`` distribution (its package metadata
  description): Markdown with badges, links, tables and shell commands, another domain.

    python3 benchmarks/quantization_quality.py [--work DIR] [--methods fp16,rtn,awq,gptq,fp8,kv-fp8]
        [--texts stdlib-docs,torch-readme] [--window 512] [--max-windows N] [--no-bos]

The RTN row is the AWQ config with ``quantization.method: rtn`` (same group size, no
calibration); the kv-fp8 row is the fp16 config with ``kv_cache.dtype: fp8``. Artifacts already
in ``--work`` that were built from the same config are reused. The table and the rows
(``quality.json`` in ``--work``) are what docs/quantization.md records.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import time
from importlib import resources
from pathlib import Path

import yaml

from trtc.artifact import Artifact
from trtc.errors import ArtifactError

# Modules whose pydoc text is the ``stdlib-docs`` held-out text: the calibration text is the
# language reference (pydoc_data.topics), these are library documentation.
STDLIB_MODULES = (
    "argparse",
    "collections",
    "itertools",
    "functools",
    "pathlib",
    "json",
    "re",
    "subprocess",
    "logging",
    "asyncio",
)
STDLIB_CHARS = 120_000


def readme_text(distribution: str = "torch") -> str:
    text = importlib.metadata.metadata(distribution).get_payload()
    if not text or len(text) < 1000:
        raise ValueError(f"the {distribution} distribution has no long description")
    return text


def stdlib_docs_text() -> str:
    import pydoc

    docs = [
        pydoc.render_doc(importlib.import_module(m), renderer=pydoc.plaintext)
        for m in STDLIB_MODULES
    ]
    return "\n\n".join(docs)[:STDLIB_CHARS]


HELDOUT = {
    "stdlib-docs": (
        stdlib_docs_text,
        f"pydoc text of {', '.join(STDLIB_MODULES)} "
        f"(Python {platform.python_version()}), first {STDLIB_CHARS} characters",
    ),
    "torch-readme": (readme_text, "README of torch {version}"),
}


CONFIGS = {
    "fp16": "smollm2.yaml",
    "rtn": "smollm2-int4-awq.yaml",
    "awq": "smollm2-int4-awq.yaml",
    "gptq": "smollm2-int4-gptq.yaml",
    "fp8": "smollm2-fp8.yaml",
    "kv-fp8": "smollm2.yaml",
}


def heldout_text(name: str = "torch-readme") -> str:
    return HELDOUT[name][0]()


def describe(name: str) -> str:
    return HELDOUT[name][1].format(version=importlib.metadata.version("torch"))


def config_for(method: str) -> dict:
    """The shipped config of a row, as the evaluation builds it: backend none (engines do not
    change the graph's numbers), RTN from the AWQ config, kv-fp8 from the fp16 config."""
    data = yaml.safe_load(resources.files("trtc.configs").joinpath(CONFIGS[method]).read_text())
    data.pop("backend", None)
    data.pop("output", None)
    if method == "kv-fp8":  # fp16 weights, FP8 KV cache (scales from the default calibration)
        data["kv_cache"] = dict(data.get("kv_cache") or {}, dtype="fp8")
        data["name"] = data["name"] + "-kv-fp8"
    if method == "rtn":
        data["quantization"] = {k: v for k, v in data["quantization"].items() if k != "calibration"}
        data["quantization"]["method"] = "rtn"
        data["name"] = data["name"].replace("awq", "rtn")
    return data


def build_or_reuse(method: str, work: Path) -> tuple[Artifact, float | None]:
    """The row's artifact in ``work``, reused if it was built from the same config (else built
    again, its build time returned too)."""
    from trtc.compiler.build import build
    from trtc.compiler.config import parse_config

    cfg = parse_config(config_for(method), CONFIGS[method])
    out = work / method
    if (out / "manifest.json").is_file():
        try:
            artifact = Artifact.open(out)
        except ArtifactError:  # written by another trtc: built again below
            artifact = None
        if artifact and artifact.manifest.build.get("config") == cfg.model_dump(mode="json"):
            return artifact, None
    t0 = time.perf_counter()
    build(cfg, output=str(out), force=True)
    return Artifact.open(out), time.perf_counter() - t0


def linear_bytes_ratio(artifact: Artifact) -> float:
    """The quantized Linears' bytes (weights, scales, zeros) over their fp16 bytes; 1 where
    nothing is quantized."""
    q = artifact.manifest.quantization
    fp16 = (q.model_extra or {}).get("linear_weight_bytes_fp16")
    return q.linear_weight_bytes_quantized / fp16 if fp16 else 1.0


def main(argv: list[str] | None = None) -> None:
    from trtc.runtime.evaluate import perplexity

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--work", default="builds/quality", help="where the artifacts are built (and reused)"
    )
    p.add_argument(
        "--methods",
        default="fp16,rtn,awq,gptq,fp8",
        help="rows, comma-separated, of: " + ", ".join(CONFIGS),
    )
    p.add_argument(
        "--texts", default=",".join(HELDOUT), help="held-out texts: " + ", ".join(HELDOUT)
    )
    p.add_argument("--window", type=int, default=512, help="tokens a window (default 512)")
    p.add_argument(
        "--max-windows", type=int, default=None, help="score only the first N windows of a text"
    )
    p.add_argument(
        "--no-bos",
        dest="bos",
        action="store_false",
        help="score windows without the BOS token before them (the tables before 2026-12-04)",
    )
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    texts = {name: heldout_text(name) for name in args.texts.split(",")}
    rows = []
    for method in args.methods.split(","):
        art, build_s = build_or_reuse(method, work)
        row = {
            "method": method,
            "group_size": art.manifest.quantization.group_size,
            "build_s": build_s,
            "linear_bytes_ratio": linear_bytes_ratio(art),
            "bos": args.bos,
            "perplexity": {},
            "tokens": {},
        }
        for name, text in texts.items():
            r = perplexity(art, text, args.window, args.max_windows, bos=args.bos)
            row["perplexity"][name], row["tokens"][name] = r["perplexity"], r["tokens"]
            print(
                f"{method:5s} {name}: perplexity {r['perplexity']:8.3f} over {r['tokens']} tokens",
                flush=True,
            )
        rows.append(row)
    base = next((r["perplexity"] for r in rows if r["method"] == "fp16"), None)
    print()
    for name in texts:
        print(
            f"held-out {name}: {describe(name)}, {rows[0]['tokens'][name]} tokens, "
            f"window {args.window}" + (", each opened by BOS" if args.bos else ", no BOS")
        )
    print(
        "| artifact | group | "
        + " | ".join(f"{n} perplexity | vs fp16" for n in texts)
        + " | Linear weight bytes vs fp16 | build (s) |"
    )
    print("| --- | ---: | " + " | ".join("---: | ---:" for _ in texts) + " | ---: | ---: |")
    for r in rows:
        cells = []
        for name in texts:
            ppl = r["perplexity"][name]
            cells += [f"{ppl:.3f}", f"{100 * (ppl / base[name] - 1):+.1f}%" if base else "-"]
        build = f"{r['build_s']:.0f}" if r["build_s"] else "reused"
        print(
            f"| {r['method']} | {r['group_size'] or '-'} | "
            + " | ".join(cells)
            + f" | {100 * r['linear_bytes_ratio']:.1f}% | {build} |"
        )
    (work / "quality.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
