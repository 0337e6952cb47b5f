"""An artifact's tokenizer, loaded as cheaply as exactness allows.

`AutoTokenizer` imports transformers' model registry on the way (generation utilities,
torch.distributed.tensor, sympy: seconds at a server's start) only to map the tokenizer
config's ``tokenizer_class`` to a class. A tokenizer saved as transformers' own
``TokenizersBackend`` (the Rust ``tokenizers`` library behind ``tokenizer.json``, what trtc
artifacts hold) is loaded through that class directly: the same class AutoTokenizer would pick,
without the registry. Any other class goes through AutoTokenizer."""

from __future__ import annotations

import json
from pathlib import Path

DIRECT_CLASSES = ("TokenizersBackend",)


def load_tokenizer(directory: str | Path):
    directory = Path(directory)
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("tokenizer_class") in DIRECT_CLASSES and (directory / "tokenizer.json").is_file():
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # a transformers without that module: the registry decides
            pass
        else:
            return TokenizersBackend.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def prompt_ids_of(tokenizer, prompt: str | list[int]) -> list[int]:
    """A completion prompt's ids: text is encoded as it stands (no BOS or other specials
    added), ids are taken as given."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return list(prompt)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation's ids through the model's chat template, ready for the reply."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
