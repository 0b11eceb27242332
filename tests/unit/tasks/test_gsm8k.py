"""GSM8K answer extraction and exact match, on real answers and written cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fs_fedpa.tasks.gsm8k import extract_answer, few_shot_prompt, gsm8k_accuracy, load_gsm8k, reference_answer

REAL = Path(__file__).resolve().parents[4] / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.mark.parametrize(
    "text,answer",
    [
        ("She pays 3 * 4 = 12 dollars.\n#### 12", "12"),
        ("#### 1,234", "1234"),
        ("The total is $1,200.50. The answer is $1,200.50.", "1200.5"),
        ("So the answer is 7.", "7"),
        ("It drops to -3 degrees; the answer is -3", "-3"),
        ("First 2, then 3.0", "3"),
        ("no number here", None),
        ("The answer is 18.\n\nQuestion: next one has 5", "18"),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_exact_match_accuracy():
    assert gsm8k_accuracy(["The answer is 12.", "#### 7", "it is 3"], ["12", "8", "3.0"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="need equally many predictions and references"):
        gsm8k_accuracy(["1"], [])


def test_reference_answer_requires_hashes():
    assert reference_answer("Work ... #### 42") == "42"
    with pytest.raises(ValueError, match="has no '#### <number>'"):
        reference_answer("no final answer")


def test_load_and_prompt(tmp_path):
    path = tmp_path / "g.jsonl"
    rows = [{"question": "1+1?", "answer": "1+1=<<1+1=2>>2\n#### 2"}, {"question": "2+3?", "answer": "#### 5"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    records = load_gsm8k(path)
    assert [r["reference"] for r in records] == ["2", "5"]
    prompt = few_shot_prompt("3+4?", records, k=1)
    assert prompt == "Question: 1+1?\nAnswer: 1+1=2 The answer is 2.\n\nQuestion: 3+4?\nAnswer:"


def test_real_references_are_their_own_answers():
    if not REAL.is_file():
        pytest.skip(f"no GSM8K data at {REAL}")
    records = load_gsm8k(REAL, limit=200)
    # the reference solution itself must extract to the reference
    assert all(extract_answer(r["answer"]) == r["reference"] for r in records)
    assert gsm8k_accuracy([r["answer"] for r in records], [r["reference"] for r in records]) == 1.0
