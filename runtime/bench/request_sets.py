"""The request sets a benchmark replays: random-token or real-text prompts with fixed output
lengths, reproducible from a seed. `trtc bench` replays them in-process and through a server,
`trtc tune` to warm an engine up; the same spec gives the same requests everywhere."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int


def make_requests(
    n: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab: int,
    seed: int,
    reserved: set[int] = frozenset(),
) -> list[BenchRequest]:
    """A reproducible request set: random token prompts (no special tokens), fixed output
    lengths."""
    rng = random.Random(seed)
    usable = [t for t in range(min(vocab, 32000)) if t not in reserved]
    return [
        BenchRequest(
            [rng.choice(usable) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len)
        )
        for _ in range(n)
    ]


def text_requests(
    token_ids: list[int],
    n: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> list[BenchRequest]:
    """A reproducible request set of real text: each prompt a window of ``token_ids`` (a text
    tokenized by the model's tokenizer) at a seeded offset, its length drawn from
    ``prompt_len``; fixed output lengths."""
    if len(token_ids) < prompt_len[1]:
        raise ValueError(
            f"the text is {len(token_ids)} tokens long: too short for prompts of up to "
            f"{prompt_len[1]} tokens (--prompt-len)"
        )
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        length = rng.randint(*prompt_len)
        start = rng.randrange(len(token_ids) - length + 1)
        requests.append(BenchRequest(token_ids[start : start + length], rng.randint(*output_len)))
    return requests


def request_set(spec: dict, vocab: int, reserved: set[int], tokenizer=None) -> list[BenchRequest]:
    """The requests of ``spec`` (`make_requests`' ``n``, ``prompt_len``, ``output_len``,
    ``seed``, and optionally ``text``: a text to cut the prompts from with ``tokenizer``,
    instead of random tokens)."""
    spec = dict(spec)
    text = spec.pop("text", None)
    if text is None:
        return make_requests(vocab=vocab, reserved=reserved, **spec)
    # verbose=False: the whole text is longer than the model's context, which is no error here
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return text_requests(list(ids), **spec)
