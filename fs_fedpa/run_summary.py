"""A run's ``summary.json`` (stub: the reader only; the coordinator's module replaces it). No FS, no torch."""

from __future__ import annotations

import json
from pathlib import Path

SUMMARY_FILE = "summary.json"
FORMAT = "fs_fedpa.summary/1"


def read_summary(folder: str | Path) -> dict | None:
    """``<folder>/summary.json`` as a dict; None where the run wrote none."""
    path = Path(folder) / SUMMARY_FILE
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(summary, dict) or summary.get("format") != FORMAT:
        raise ValueError(f"{path}: not a run summary (expected a JSON object with \"format\": \"{FORMAT}\")")
    return summary
