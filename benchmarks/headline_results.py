"""The results of `headline.py`: one JSON document, rewritten whole after every step so that a run
stopped at its time limit keeps every step that finished, and the Markdown table of headline
figures made from it (`headline.py --table`).

The document: ``{"script", "argv", "card", "started", "entries": [...]}``. An entry is one step
(a measurement, or a build it needs): ``name``, ``status`` (``ok``, ``failed``, ``timed out``,
``skipped``), ``command`` (what ran, as a shell line or a function), ``card``
(``torch.cuda.get_device_name()``), ``date`` (UTC, when it ended), ``seconds``, ``figures``
(numbers), ``rows`` (``[metric, figure]`` pairs for the table), ``raw`` (the JSON the command
wrote, where it writes one) and ``error``.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import UTC, datetime
from pathlib import Path

STATUSES = ("ok", "failed", "timed out", "skipped")


def utc_now() -> str:
    """Now, UTC, to the second: ``2026-12-08T10:11:12Z``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ResultsFile:
    """The results document at ``path``, written again (to a temporary file, then renamed, so
    it is whole at every moment) each time an entry is added; safe from several threads."""

    def __init__(self, path: Path, header: dict):
        self.path = path
        self.doc = {**header, "entries": []}
        self._lock = threading.Lock()
        self.write()

    def add(self, entry: dict) -> None:
        if entry["status"] not in STATUSES:
            raise ValueError(f"status {entry['status']!r}: one of {STATUSES}")
        with self._lock:
            self.doc["entries"].append(entry)
            self.write()

    def ok(self, name: str) -> dict | None:
        """The latest entry of ``name`` that succeeded, if any."""
        found = [e for e in self.doc["entries"] if e["name"] == name and e["status"] == "ok"]
        return found[-1] if found else None

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2))
        os.replace(tmp, self.path)


# --- figures as the table shows them -------------------------------------------------------------


def tokens_per_s(x: float) -> str:
    return f"{x:,.0f}"


def millis(seconds: float | None) -> str:
    """Seconds as milliseconds, three significant digits or more."""
    if seconds is None:
        return "-"
    ms = 1000 * seconds
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def bench_case(result: dict) -> dict:
    """The figures of one `trtc bench --json` result (one mode): output tokens/s, TTFT and
    TPOT p50 / p99 in seconds, the run's duration."""
    return {
        "output_tokens_per_s": result["output_tokens_per_s"],
        "ttft_s": {p: result["ttft_s"][p] for p in ("p50", "p99")},
        "tpot_s": {p: result["tpot_s"][p] for p in ("p50", "p99")},
        "duration_s": result["duration_s"],
    }


def bench_row(label: str, case: dict) -> list[str]:
    """``[metric, figure]`` of a `bench_case`: tokens/s, then TTFT and TPOT p50 / p99."""
    ttft, tpot = case["ttft_s"], case["tpot_s"]
    return [
        f"{label}: output tok/s",
        f"{tokens_per_s(case['output_tokens_per_s'])} (TTFT p50 / p99 {millis(ttft['p50'])} / "
        f"{millis(ttft['p99'])} ms, TPOT p50 / p99 {millis(tpot['p50'])} / "
        f"{millis(tpot['p99'])} ms)",
    ]


# --- the Markdown table --------------------------------------------------------------------------


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _date(iso: str) -> str:
    """``2026-12-08T10:11:12Z`` -> ``2026-12-08 10:11 UTC``."""
    return f"{iso[:10]} {iso[11:16]} UTC" if len(iso) >= 16 else iso


def table(doc: dict) -> str:
    """The headline table of a results document: a row for each figure of every entry that
    succeeded, with its card, date and command; then a line for each step that did not."""
    lines = ["| metric | figure | card | date | command |", "| --- | --- | --- | --- | --- |"]
    for e in doc["entries"]:
        if e["status"] != "ok":
            continue
        for metric, figure in e.get("rows", []):
            cells = (metric, figure, e["card"], _date(e["date"]), f"`{e['command']}`")
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    missed = [e for e in doc["entries"] if e["status"] != "ok"]
    if missed:
        lines.append("")
        lines += [
            f"- not measured: {e['name']} ({e['status']}: {e.get('error', '')})" for e in missed
        ]
    return "\n".join(lines)
