"""HumanEval completions and pass@1 by execution on real problems (canonical solutions pass, broken ones fail)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fs_fedpa.tasks.humaneval import completion_from_generation, load_humaneval, pass_at_1

REAL = Path(__file__).resolve().parents[4] / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"


def test_completion_stops_at_top_level_code():
    text = "    return a + b\n\n\ndef other():\n    pass\n"
    assert completion_from_generation(text) == "    return a + b\n\n"
    assert completion_from_generation("    return 1") == "    return 1"


@pytest.fixture(scope="module")
def problems():
    if not REAL.is_file():
        pytest.skip(f"no HumanEval data at {REAL}")
    return load_humaneval(REAL)


def test_canonical_solutions_pass_and_broken_ones_fail(problems):
    assert len(problems) == 164
    chosen = problems[:3]
    good = [{"task_id": p["task_id"], "completion": p["canonical_solution"]} for p in chosen]
    bad = [{"task_id": p["task_id"], "completion": "    return None\n"} for p in chosen]
    assert pass_at_1(good, chosen) == 1.0
    assert pass_at_1(bad, chosen) == 0.0


def test_unknown_task_is_an_error(problems):
    with pytest.raises(ValueError, match="samples for unknown tasks"):
        pass_at_1([{"task_id": "nope", "completion": ""}], problems[:1])
