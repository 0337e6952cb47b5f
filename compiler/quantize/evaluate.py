"""The quantization quality table: SmolLM2 built from the shipped configs (fp16, INT4 RTN / AWQ /
GPTQ, FP8), each artifact's perplexity measured by `trtc eval`'s code (the runtime's executor on
the compiled graph, plugin nodes included) on held-out text, against the fp16 artifact.

Held-out text: the README of the installed ``torch`` distribution (its package metadata
description): stable for a pinned torch, English prose with some code, and not the calibration
text (``pydoc_data.topics``).

    python -m trtc.compiler.quantize.evaluate [--work DIR] [--methods fp16,rtn,awq,gptq,fp8]
        [--window 512] [--max-windows N]

The RTN row is the AWQ config with ``quantization.method: rtn`` (same group size, no
calibration). Artifacts already in ``--work`` that were built from the same config are reused.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from importlib import resources
from pathlib import Path

import yaml

HELDOUT = "torch"     # distribution whose README is the held-out text
CONFIGS = {"fp16": "smollm2.yaml", "rtn": "smollm2-int4-awq.yaml", "awq": "smollm2-int4-awq.yaml",
           "gptq": "smollm2-int4-gptq.yaml", "fp8": "smollm2-fp8.yaml"}


def heldout_text(distribution: str = HELDOUT) -> str:
    text = importlib.metadata.metadata(distribution).get_payload()
    if not text or len(text) < 1000:
        raise ValueError(f"the {distribution} distribution has no long description")
    return text


def config_for(method: str) -> dict:
    """The shipped config of a row, as the evaluation builds it: backend none (engines do not
    change the graph's numbers), RTN from the AWQ config."""
    data = yaml.safe_load(resources.files("trtc.configs").joinpath(CONFIGS[method]).read_text())
    data.pop("backend", None)
    data.pop("output", None)
    if method == "rtn":
        data["quantization"] = {k: v for k, v in data["quantization"].items() if k != "calibration"}
        data["quantization"]["method"] = "rtn"
        data["name"] = data["name"].replace("awq", "rtn")
    return data


def build_or_reuse(method: str, work: Path) -> tuple[Path, float | None]:
    from trtc.compiler.build import build
    from trtc.compiler.config import parse_config
    cfg = parse_config(config_for(method), CONFIGS[method])
    out = work / method
    manifest = out / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text())["build"]["config"] == cfg.model_dump(mode="json"):
        return out, None
    t0 = time.perf_counter()
    build(cfg, output=str(out), force=True)
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    from trtc.runtime.evaluate import perplexity
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="builds/quality", help="where the artifacts are built (and reused)")
    p.add_argument("--methods", default="fp16,rtn,awq,gptq,fp8")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=None)
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    text = heldout_text()
    rows = []
    for method in args.methods.split(","):
        art, build_s = build_or_reuse(method, work)
        m = json.loads((art / "manifest.json").read_text())
        r = perplexity(art, text, args.window, args.max_windows)
        q = m["quantization"]
        rows.append({"method": method, "group_size": q.get("group_size"), "perplexity": r["perplexity"],
                     "tokens": r["tokens"], "build_s": build_s,
                     "linear_bytes_ratio": (q["linear_weight_bytes_quantized"] / q["linear_weight_bytes_fp16"]
                                            if "linear_weight_bytes_fp16" in q else 1.0)})
        print(f"{method:5s} perplexity {r['perplexity']:8.3f} over {r['tokens']} tokens", flush=True)
    base = next((r["perplexity"] for r in rows if r["method"] == "fp16"), None)
    print(f"\nheld-out text: README of {HELDOUT} {importlib.metadata.version(HELDOUT)}, window {args.window}")
    print("| artifact | group | perplexity | vs fp16 | Linear weight bytes vs fp16 | build (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        rel = f"{100 * (r['perplexity'] / base - 1):+.1f}%" if base else "-"
        build = f"{r['build_s']:.0f}" if r["build_s"] else "reused"
        print(f"| {r['method']} | {r['group_size'] or '-'} | {r['perplexity']:.3f} | {rel} | "
              f"{100 * r['linear_bytes_ratio']:.1f}% | {build} |")
    (work / "quality.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
