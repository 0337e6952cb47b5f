"""The artifacts `headline.py` measures, each prepared once, on first use, by key:

- ``1b``: the 1.1B geometry in fp16, ``python3 -m trtc build configs/llama-1b-random.yaml``,
  then ``trtc tune`` (the journal's 1.1B figures are of a tuned build);
- ``1b_int4``: its INT4 build, ``configs/llama-1b-random-int4.yaml`` (RTN, group 128), untuned
  as the journal's INT4 figures were;
- ``8b``: the Llama-3-8B geometry, ``trtc checkpoint llama-3-8b`` (random weights, 16 GB), built
  in fp16 with the 1.1B config's precision, KV cache and limits (`config_8b`), then tuned.

An artifact given on the command line is used as it is (tuned first where its key is tuned);
one left in the work folder by an earlier run is used again. A tune that fails leaves the
artifact untuned: the measurements still run, and their figures say ``tuned: false``."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import yaml
from headline_runs import Headline, shown

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"1b": "configs/llama-1b-random.yaml", "1b_int4": "configs/llama-1b-random-int4.yaml"}
TUNED = ("1b", "8b")
CHECKPOINT_8B = "llama-3-8b"
LIMITS = {"build": 300, "build_8b": 420, "checkpoint": 300, "tune": 240}


def config_8b(checkpoint: Path) -> dict:
    """The 8B geometry's build config: `configs/llama-1b-random.yaml` (precision, KV cache and
    limits: 4,096 tokens a step, 64 sequences, 2,048 positions) with ``checkpoint`` as the
    model, as the journal's 8B artifacts were built."""
    config = yaml.safe_load((REPO / CONFIGS["1b"]).read_text())
    config.pop("output", None)
    return {
        **config,
        "name": "llama-3-8b-random",
        "model": {"source": "hf", "path": str(checkpoint)},
    }


def is_tuned(artifact: Path) -> bool:
    """Whether ``trtc tune`` recorded its kernels in the artifact's manifest."""
    return bool(json.loads((artifact / "manifest.json").read_text()).get("tuning"))


def build(h: Headline, name: str, config: Path, out: Path, limit: float, background=False):
    """``trtc build CONFIG -o OUT`` as step ``name``; the artifact, or None if it failed. One
    already at ``out`` (a build appears there only when whole) is used again."""
    argv = [sys.executable, "-m", "trtc", "build", config, "-o", out]
    reused = (out / "manifest.json").exists()

    def body(seconds: float, log: Path) -> dict:
        if not reused:
            h.runner.run(argv, seconds, log)
        return {"figures": {"artifact": str(out), "reused": reused}}

    return out if h.step(name, shown(argv), body, limit, background) is not None else None


def checkpoint_8b(h: Headline) -> Path | None:
    """``trtc checkpoint llama-3-8b`` into the work folder (once: the directory appears only
    when complete); None if it failed."""
    out = h.options.work / f"{CHECKPOINT_8B}-checkpoint"
    if (out / "config.json").exists():
        return out
    argv = [sys.executable, "-m", "trtc", "checkpoint", CHECKPOINT_8B, "--output", out]

    def body(seconds: float, log: Path) -> dict:
        h.runner.run(argv, seconds, log)
        return {"figures": {"checkpoint": str(out)}}

    ok = h.step("checkpoint_8b", shown(argv), body, LIMITS["checkpoint"]) is not None
    return out if ok else None


def build_untuned(h: Headline, key: str, background: bool = False) -> Path | None:
    """The artifact of ``key`` as built (or given), before any tuning."""
    if key in h.options.given:
        given = h.options.given[key]
        if (given / "manifest.json").exists():
            return given
        h.skip(f"build_{key}", f"--artifact-{key.replace('_', '-')} {given}", "no manifest.json")
        return None
    work = h.options.work
    if key == "8b":
        checkpoint = checkpoint_8b(h)
        if checkpoint is None:
            return None
        config = work / "llama-3-8b-random.yaml"
        config.write_text(yaml.safe_dump(config_8b(checkpoint), sort_keys=False))
        return build(h, "build_8b", config, work / "llama-3-8b-random", LIMITS["build_8b"])
    config = REPO / CONFIGS[key]
    return build(h, f"build_{key}", config, work / config.stem, LIMITS["build"], background)


def tune(h: Headline, key: str, artifact: Path) -> None:
    """``trtc tune ARTIFACT`` as step ``tune_KEY`` (a failure is recorded; the artifact stays
    usable, untuned)."""
    argv = [sys.executable, "-m", "trtc", "tune", artifact]

    def body(seconds: float, log: Path) -> dict:
        h.runner.run(argv, seconds, log)
        return {"figures": {"artifact": str(artifact)}}

    h.step(f"tune_{key}", shown(argv), body, LIMITS["tune"])


def built(h: Headline, key: str, background: bool = False) -> Path | None:
    """`build_untuned`, once per key."""
    if key not in h.built:
        h.built[key] = build_untuned(h, key, background)
    return h.built[key]


def prepared(h: Headline, key: str) -> Path | None:
    """The artifact of ``key``, built and (where its key is) tuned, once per key; None if it
    could not be built."""
    if key not in h.artifacts:
        path = built(h, key)
        if path is not None and key in TUNED and not is_tuned(path):
            tune(h, key, path)
        h.artifacts[key] = path
    return h.artifacts[key]


def build_beside(h: Headline, keys: list[str]) -> list[threading.Thread]:
    """Start the builds of ``keys`` (the CPU's work: nothing on the GPU) on threads of their
    own, side by side; join them before measuring anything the builds could slow down."""
    threads = [
        threading.Thread(target=built, args=(h, key, True), name=f"build-{key}", daemon=True)
        for key in keys
        if key not in h.built and key != "8b"
    ]
    for t in threads:
        t.start()
    return threads
