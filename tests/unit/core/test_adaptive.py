"""Adaptive lambda rules of Appendix F against hand-computed values and their stated ranges."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa.core.adaptive import lam_direction, lam_grad, lam_loss, normalized_factor_grads


@settings(max_examples=100, deadline=None)
@given(loss=st.floats(0, 1e6), lam0=st.floats(1e-3, 10), alpha=st.floats(0, 10))
def test_loss_rule_stays_in_its_range(loss, lam0, alpha):
    lam = lam_loss(loss, lam0, alpha)
    assert 0 < lam <= lam0
    assert lam == pytest.approx(lam0 / (1 + alpha * loss))


def test_loss_rule_decreases_with_the_loss_and_takes_tensors():
    assert lam_loss(torch.tensor(0.0)) == 1.0
    assert lam_loss(1.0, lam0=2.0, alpha=3.0) == pytest.approx(0.5)
    assert lam_loss(2.0) < lam_loss(1.0)


def test_normalized_grads_divide_by_the_complementary_factor_norm():
    B, A = torch.full((3, 2), 2.0), torch.full((2, 4), 1.0)  # ||B|| = sqrt(24), ||A|| = sqrt(8)
    gB, gA = torch.ones(3, 2), torch.ones(2, 4)
    v = normalized_factor_grads([gB], [gA], [B], [A], eps=0.0)
    expected = torch.cat([gB.flatten() / math.sqrt(8), gA.flatten() / math.sqrt(24)])
    torch.testing.assert_close(v, expected)
    g_hat = float(v.norm())
    assert g_hat == pytest.approx(math.sqrt(6 / 8 + 8 / 24))  # Eq. (F.2) surrogate


def test_grad_rule_clips_to_its_bounds():
    assert lam_grad(2.0, 1.0, alpha=1.0, eps=0.0) == pytest.approx(2.0)
    assert lam_grad(100.0, 1.0) == 10.0
    assert lam_grad(0.0, 1.0, lam_min=0.5) == 0.5
    assert lam_grad(1.0, 0.0) == 10.0  # no mismatch yet: the clip keeps it finite


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 50), lam0=st.floats(1e-3, 10))
def test_direction_rule_stays_in_zero_to_two_lam0(seed, n, lam0):
    g = torch.Generator().manual_seed(seed)
    g_f, g_r = torch.randn(n, generator=g), torch.randn(n, generator=g)
    lam = lam_direction(g_f, g_r, lam0)
    assert 0 <= lam <= 2 * lam0
    # Eq. (F.3) with its eps = 1e-8, evaluated independently in numpy float64
    f, r = g_f.double().numpy(), g_r.double().numpy()
    expected = lam0 * (1 - float(f @ r) / (float(np.linalg.norm(f) * np.linalg.norm(r)) + 1e-8))
    assert lam == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_direction_rule_extremes():
    v = torch.tensor([1.0, 2.0, 3.0])
    assert lam_direction(v, v) == pytest.approx(0.0, abs=1e-6)
    assert lam_direction(v, -v) == pytest.approx(2.0, abs=1e-6)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: lam_loss(-1.0), r"loss\(=-1.0\) must be a non-negative task loss"),
        (lambda: lam_loss(float("nan")), r"loss\(=nan\)"),
        (lambda: lam_loss(1.0, lam0=-1), r"lam0\(=-1\) must be >= 0"),
        (lambda: lam_grad(1.0, 1.0, lam_min=5, lam_max=1), r"need lam_max\(=1\) > lam_min\(=5\) >= 0"),
        (lambda: lam_grad(-1.0, 1.0), r"g_hat\(=-1.0\) and mismatch\(=1.0\) must be non-negative"),
        (lambda: lam_direction(torch.ones(2), torch.ones(3)), r"g_f \(2,\) and g_r \(3,\) differ in shape"),
        (lambda: normalized_factor_grads([], [], [], []), r"need the same non-zero number"),
        (
            lambda: normalized_factor_grads(
                [torch.ones(2, 2)], [torch.ones(2, 3)], [torch.ones(3, 2)], [torch.ones(2, 3)]
            ),
            r"gradient shapes",
        ),
    ],
)
def test_adaptive_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()
