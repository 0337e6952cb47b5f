"""The engine's tokenizer loader gives what AutoTokenizer gives, without its model registry."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from trtc.runtime.engine.tokenizer import load_tokenizer

TEXTS = ["Hello, world!", "naïve café — 東京 🙂", "  leading spaces\nand\ttabs", ""]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 times 7?"},
    {"role": "assistant", "content": "84."},
    {"role": "user", "content": "And 13 times 7?"},
]


def same(directory):
    ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
    assert type(ours) is type(theirs)
    for text in TEXTS:
        ids = ours(text, add_special_tokens=False)["input_ids"]
        assert ids == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
    if theirs.chat_template:
        kw = dict(add_generation_prompt=True, tokenize=True)
        assert ours.apply_chat_template(CHAT, **kw) == theirs.apply_chat_template(CHAT, **kw)
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.get_vocab() == theirs.get_vocab()


def test_tiny_artifact_tokenizer_matches_autotokenizer(tiny_artifacts):
    same(tiny_artifacts["tiny-llama"] / "tokenizer")


@pytest.mark.slow
def test_smollm2_tokenizer_matches_autotokenizer(smollm2_fp32):
    same(smollm2_fp32 / "tokenizer")


def test_loading_it_leaves_the_model_registry_unimported(tiny_artifacts):
    code = (
        "import sys; from trtc.runtime.engine.tokenizer import load_tokenizer; "
        f"load_tokenizer({str(tiny_artifacts['tiny-llama'] / 'tokenizer')!r}); "
        "print('transformers.models.auto.auto_factory' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
