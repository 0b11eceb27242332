"""The run-wide learning-rate schedule against its closed forms."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fs_fedpa.core.schedule import lr_factor


@given(total=st.integers(2, 500), warmup=st.integers(0, 50), data=st.data())
def test_cosine_and_constant_follow_their_closed_forms(total, warmup, data):
    step = data.draw(st.integers(0, total + 5))
    if step < warmup:
        expected = (step + 1) / warmup
        assert lr_factor(step, total, warmup, "constant") == pytest.approx(expected)
        assert lr_factor(step, total, warmup, "cosine") == pytest.approx(expected)
        return
    assert lr_factor(step, total, warmup, "constant") == 1.0
    if total > warmup:
        angle = math.pi * min(step - warmup, total - warmup) / (total - warmup)
        assert lr_factor(step, total, warmup, "cosine") == pytest.approx((1 + math.cos(angle)) / 2, abs=1e-12)


def test_the_ends_of_the_schedule():
    assert lr_factor(0, 100, 10, "cosine") == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, "cosine") == 1.0 and lr_factor(10, 100, 10, "cosine") == 1.0
    assert lr_factor(100, 100, 10, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(55, 100, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(7, 100, 0, "none") == 1.0
    with pytest.raises(ValueError, match="must be one of"):
        lr_factor(0, 10, 0, "linear")
