"""Upload checks: every way an upload can be unusable is named; a good upload passes."""

from __future__ import annotations

import re

import pytest
import torch

from fs_fedpa.core.uploads import upload_problem

SHAPES = {"q": (6, 5), "v": (6, 7)}


def _upload(rank=2):
    return {n: (torch.randn(d, rank), torch.randn(rank, k)) for n, (d, k) in SHAPES.items()}


def test_a_good_upload_passes():
    shared = {"head": torch.zeros(3, 2)}
    assert upload_problem(_upload(), SHAPES, 2, shared, {"head": (3, 2)}) is None


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda u, s: u.pop("v"), r"LoRA modules missing from the upload: \['v'\]"),
        (lambda u, s: u.update(k=u["q"]), r"unknown LoRA modules in the upload: \['k'\]"),
        (lambda u, s: u.update(q=(torch.randn(6, 3), torch.randn(3, 5))), r"q: B \(6, 3\) and A \(3, 5\), expected"),
        (lambda u, s: u.update(v=(torch.randn(6, 2), torch.randn(2, 6))), r"expected \(6, 2\) and \(2, 7\)"),
        (lambda u, s: u["q"][0].__setitem__((0, 0), float("nan")), r"q: NaN or Inf in B"),
        (lambda u, s: u["v"][1].__setitem__((1, 3), float("inf")), r"v: NaN or Inf in A"),
        (lambda u, s: s.update(head=torch.zeros(2, 2)), r"shared tensor head: shape \(2, 2\), expected \(3, 2\)"),
        (lambda u, s: s["head"].__setitem__((0, 0), float("-inf")), r"shared tensor head: NaN or Inf"),
        (lambda u, s: s.pop("head"), r"shared tensors \[\] differ from the expected \['head'\]"),
    ],
)
def test_each_problem_is_named(corrupt, match):
    upload, shared = _upload(), {"head": torch.zeros(3, 2)}
    corrupt(upload, shared)
    problem = upload_problem(upload, SHAPES, 2, shared, {"head": (3, 2)})
    assert problem is not None and re.search(match, problem), problem
