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


def _direct_config(directory: Path) -> dict | None:
    """The ``tokenizer_config.json`` of a tokenizer saved as one of `DIRECT_CLASSES` over a
    ``tokenizer.json`` (what trtc artifacts hold); None for any other."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if config.get("tokenizer_class") in DIRECT_CLASSES and (directory / "tokenizer.json").is_file():
        return config
    return None


def load_tokenizer(directory: str | Path):
    directory = Path(directory)
    if _direct_config(directory) is not None:
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # a transformers without that module: the registry decides
            pass
        else:
            return TokenizersBackend.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


class Detokenizer:
    """What an engine that gets its prompts as ids needs of a tokenizer (ids to text, a
    token's id), from the Rust ``tokenizers`` library alone: transformers' import is left to
    the process that encodes prompts (a server's engine process would pay seconds of its start
    for it, and the interpreter lock it holds is taken from loading the model beside it).
    `load_detokenizer` uses it only where its decode is the full tokenizer's."""

    clean_up_tokenization_spaces = False

    def __init__(self, backend, unk_token: str | None = None):
        self._tokenizer = backend  # (the name transformers' fast tokenizers give theirs)
        self.unk_token_id = backend.token_to_id(unk_token) if unk_token else None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)


def load_detokenizer(directory: str | Path):
    """A `Detokenizer` for a tokenizer saved as ``TokenizersBackend`` over ``tokenizer.json``,
    its special tokens named in ``tokenizer_config.json`` alone, that does not clean up spaces
    after decoding (its decode is then the library's own); the full tokenizer otherwise."""
    directory = Path(directory)
    config = _direct_config(directory)
    if (
        config is not None
        and not config.get("clean_up_tokenization_spaces", False)
        and not (directory / "special_tokens_map.json").exists()
    ):
        from tokenizers import Tokenizer

        unk = config.get("unk_token")
        unk = unk.get("content") if isinstance(unk, dict) else unk
        return Detokenizer(Tokenizer.from_file(str(directory / "tokenizer.json")), unk)
    return load_tokenizer(directory)


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


# Tokens that end a chat turn in the families trtc serves, beside the tokenizer's own EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>")


def end_of_turn_ids(tokenizer) -> set[int]:
    """The ids of `END_OF_TURN_TOKENS` this tokenizer has: a chat model stops generating at
    them even where its config names another EOS."""
    ids = set()
    for token in END_OF_TURN_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids
