"""The built-in text: real English prose every Python ships, for the compiler's calibration
and the benchmarks' real-text prompts, with no download.

It is the Python documentation's topics (`pydoc_data.topics.topics`: the language reference
pages behind ``help('TOPIC')``), values joined in sorted key order."""

from __future__ import annotations

from pathlib import Path

DEFAULT_SOURCE = "pydoc_data.topics"


def default_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def read_text(source: str) -> str:
    """``pydoc`` (or `DEFAULT_SOURCE`): the built-in text; otherwise a UTF-8 file's text."""
    if source in ("pydoc", DEFAULT_SOURCE):
        return default_text()
    path = Path(source)
    if not path.is_file():
        raise ValueError(
            f"{source!r} is neither 'pydoc' (the built-in text) nor a file: give 'pydoc' or the "
            "path of a UTF-8 text file"
        )
    return path.read_text(encoding="utf-8")
