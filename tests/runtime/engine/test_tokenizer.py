"""The engine's tokenizer loader gives what AutoTokenizer gives, without its model registry."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from trtc.runtime.engine.tokenizer import Detokenizer, load_detokenizer, load_tokenizer

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


def same_decoding(directory):
    """The engine process's decode-only tokenizer decodes as the full one does."""
    full, light = load_tokenizer(directory), load_detokenizer(directory)
    assert isinstance(light, Detokenizer)
    rng = random.Random(0)
    vocab = len(full.get_vocab())
    special = list(full.all_special_ids)
    for _ in range(200):  # random ids (partial UTF-8 pieces too), specials among them
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))] + rng.sample(
            special, min(len(special), rng.randint(0, 2))
        )
        rng.shuffle(ids)
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == full.decode(
                ids, skip_special_tokens=skip
            ), ids
    # What the engine's end-of-turn ids are read with: an unknown token is the unknown id (or
    # none) on both.
    assert light.unk_token_id == full.unk_token_id
    for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "not-a-token"):
        want = full.convert_tokens_to_ids(token)
        got = light.convert_tokens_to_ids(token)
        assert got == want or (got is None and want in (None, full.unk_token_id)), token
    assert light.get_vocab() == full.get_vocab()


def test_tiny_artifact_tokenizer_matches_autotokenizer(tiny_artifacts):
    same(tiny_artifacts["tiny-llama"] / "tokenizer")
    same_decoding(tiny_artifacts["tiny-llama"] / "tokenizer")


@pytest.mark.slow
def test_smollm2_tokenizer_matches_autotokenizer(smollm2_fp32):
    same(smollm2_fp32 / "tokenizer")
    same_decoding(smollm2_fp32 / "tokenizer")


def test_a_tokenizer_that_cleans_up_spaces_is_loaded_whole(tiny_artifacts, tmp_path):
    """Its decode differs from the Rust library's (spaces before punctuation removed)."""
    directory = tmp_path / "tokenizer"
    shutil.copytree(tiny_artifacts["tiny-llama"] / "tokenizer", directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["clean_up_tokenization_spaces"] = True
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert not isinstance(load_detokenizer(directory), Detokenizer)


def test_loading_it_leaves_the_model_registry_unimported(tiny_artifacts):
    code = (
        "import sys; from trtc.runtime.engine.tokenizer import load_tokenizer; "
        f"load_tokenizer({str(tiny_artifacts['tiny-llama'] / 'tokenizer')!r}); "
        "print('transformers.models.auto.auto_factory' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
