"""Calibration text -> token batches, deterministically.

The default text is the built-in one (`trtc.corpus`: the Python documentation's topics, which
every Python ships). It needs no download, and its hash goes into the manifest so a build can
say exactly what it calibrated on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from trtc.corpus import DEFAULT_SOURCE, default_text


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class CalibrationData:
    batches: list[list[int]]  # num_samples token windows of seq_len tokens each
    source: str  # "file" or DEFAULT_SOURCE
    path: str | None  # the file as its caller named it (a build: as the config wrote it)
    text_sha256: str
    num_samples: int
    seq_len: int

    def record(self) -> dict:
        return {
            "source": self.source,
            "path": self.path,
            "text_sha256": self.text_sha256,
            "num_samples": self.num_samples,
            "seq_len": self.seq_len,
        }


def load_text(path: str | Path | None, name: str | None) -> tuple[str, str]:
    """``(text, source)``: the file's text (UTF-8), or the default text. Messages call the file
    ``name``."""
    if path is None:
        return default_text(), DEFAULT_SOURCE
    p = Path(path)
    if not p.is_file():
        raise ValueError(
            f"calibration file {name!r} does not exist (quantization.calibration.path; "
            f"leave it unset to calibrate on the built-in {DEFAULT_SOURCE} text)"
        )
    return p.read_text(encoding="utf-8"), "file"


def window_starts(num_tokens: int, num_samples: int, seq_len: int) -> list[int]:
    """``num_samples`` window starts spread evenly over the token stream, first at 0 and last
    ending at the stream's end. Windows are disjoint when the text is long enough, and overlap
    (still evenly spaced) when it is not."""
    last = num_tokens - seq_len
    if num_samples == 1:
        return [0]
    return [round(i * last / (num_samples - 1)) for i in range(num_samples)]


def calibration_data(
    tokenizer, path: str | Path | None, num_samples: int, seq_len: int, name: str | None = None
) -> CalibrationData:
    """Tokenize the text once (no special tokens) and cut ``num_samples`` windows of
    ``seq_len`` tokens, spread evenly over it (see `window_starts`). The record and messages
    call the file ``name`` (default: ``path`` as given)."""
    if num_samples < 1 or seq_len < 1:
        raise ValueError(
            f"calibration wants num_samples >= 1 and seq_len >= 1, got {num_samples} and {seq_len}"
        )
    if path is not None:
        name = name or str(path)
    text, source = load_text(path, name)
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) < seq_len:
        where = f"calibration file {name!r}" if path else f"the {DEFAULT_SOURCE} text"
        raise ValueError(
            f"{where} has {len(ids)} tokens, fewer than one sample of seq_len "
            f"{seq_len}: give a longer text or a smaller seq_len"
        )
    starts = window_starts(len(ids), num_samples, seq_len)
    return CalibrationData(
        [list(ids[s : s + seq_len]) for s in starts],
        source,
        name,
        text_sha256(text),
        num_samples,
        seq_len,
    )


def calibration_token_batches(
    tokenizer, path: str | Path | None, num_samples: int, seq_len: int
) -> list[list[int]]:
    """``num_samples`` lists of ``seq_len`` token ids (see `calibration_data`)."""
    return calibration_data(tokenizer, path, num_samples, seq_len).batches
