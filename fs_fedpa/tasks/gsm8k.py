"""GSM8K: the official jsonl, final-answer extraction and exact-match accuracy (the paper's GSM8K metric).

A reference answer ends with ``#### <number>``. A model's answer is read from, in order: ``#### N``,
``The answer is N`` (FS-LLM replaces ``####`` by this phrase in its training targets), or the last
number in the text. Numbers are compared after removing ``,`` ``$`` and a trailing ``.``, and as
numbers (``3.0`` equals ``3``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_HASHES = re.compile(rf"####\s*({_NUMBER})")
_PHRASE = re.compile(rf"[Tt]he answer is:?\s*({_NUMBER})")
_ANY = re.compile(_NUMBER)


def normalize(number: str) -> str:
    """``'$1,234.50'`` -> ``'1234.5'``; integers print without a decimal point."""
    text = number.replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else repr(value)


def extract_answer(text: str) -> str | None:
    """The final numeric answer of a solution text, normalised, or None if it has no number."""
    for pattern in (_HASHES, _PHRASE):
        matches = pattern.findall(text)
        if matches:
            return normalize(matches[-1])
    matches = _ANY.findall(text)
    return normalize(matches[-1]) if matches else None


def reference_answer(answer_field: str) -> str:
    """The gold answer of an official GSM8K record (after ``####``)."""
    found = _HASHES.findall(answer_field)
    if not found:
        raise ValueError(f"GSM8K answer has no '#### <number>': {answer_field[-80:]!r}")
    return normalize(found[-1])


def exact_match(prediction: str, reference: str) -> bool:
    answer = extract_answer(prediction)
    return answer is not None and answer == normalize(reference)


def gsm8k_accuracy(predictions: list[str], references: list[str]) -> float:
    if not predictions or len(predictions) != len(references):
        raise ValueError(f"need equally many predictions and references, got {len(predictions)}, {len(references)}")
    return sum(exact_match(p, r) for p, r in zip(predictions, references)) / len(predictions)


def load_gsm8k(path: str | Path, limit: int | None = None) -> list[dict]:
    """``[{question, answer, reference}]`` from an official GSM8K jsonl (``question``/``answer`` keys)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{path}, line {line_no}: a GSM8K record needs 'question' and 'answer'")
            records.append({**row, "reference": reference_answer(row["answer"])})
            if limit is not None and len(records) >= limit:
                break
    return records


def few_shot_prompt(question: str, shots: list[dict], k: int = 8) -> str:
    """Chain-of-thought prompt: ``k`` solved training examples, then the question.

    Each shot is ``Question: <q>\\nAnswer: <worked solution> The answer is <n>.`` (calculator
    annotations ``<<...>>`` removed), separated by blank lines; the prompt ends with ``Answer:``.
    """
    blocks = []
    for shot in shots[:k]:
        steps = re.sub(r"<<[^>]*>>", "", shot["answer"].split("####")[0]).strip()
        blocks.append(
            f"Question: {shot['question']}\nAnswer: {steps} The answer is {reference_answer(shot['answer'])}."
        )
    blocks.append(f"Question: {question}\nAnswer:")
    return "\n\n".join(blocks)
