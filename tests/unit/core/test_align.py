"""Procrustes rotations against known rotations and brute force."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa.core.align import procrustes_rotation, rotate_to


def _rotation(r, seed):
    Q, _ = torch.linalg.qr(torch.randn(r, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    if torch.linalg.det(Q) < 0:
        Q[:, 0] = -Q[:, 0]
    return Q


@settings(max_examples=50, deadline=None)
@given(r=st.integers(1, 6), k=st.integers(6, 20), seed=st.integers(0, 2**31 - 1), which=st.sampled_from(["A", "B"]))
def test_a_rotated_copy_is_aligned_back_exactly(r, k, seed, which):
    # Prepare: the client's factors are the global ones in a rotated gauge
    g = torch.Generator().manual_seed(seed)
    B_g, A_g = torch.randn(k, r, generator=g, dtype=torch.float64), torch.randn(r, k, generator=g, dtype=torch.float64)
    Q = _rotation(r, seed + 1)
    B, A = B_g @ Q, Q.T @ A_g
    # Execute
    B2, A2, R = rotate_to(B, A, B_g, A_g, which)
    # Assert
    torch.testing.assert_close(R.T @ R, torch.eye(r, dtype=torch.float64))
    assert float(torch.linalg.det(R)) == pytest.approx(1.0)
    torch.testing.assert_close(B2, B_g)
    torch.testing.assert_close(A2, A_g)


def test_rotation_is_optimal_among_random_rotations():
    g = torch.Generator().manual_seed(0)
    M = torch.randn(3, 3, generator=g, dtype=torch.float64)
    best = float(torch.trace(procrustes_rotation(M).T @ M))
    assert all(float(torch.trace(_rotation(3, s).T @ M)) <= best + 1e-12 for s in range(200))


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="alignment needs factors of the reference's shape"):
        rotate_to(torch.zeros(4, 2), torch.zeros(2, 5), torch.zeros(4, 3), torch.zeros(3, 5), "A")


@settings(max_examples=40, deadline=None)
@given(r=st.integers(1, 5), seed=st.integers(0, 2**31 - 1), strength=st.floats(0.0, 1.0))
def test_soft_rotation_is_a_rotation_between_identity_and_the_full_one(r, seed, strength):
    g = torch.Generator().manual_seed(seed)
    B_g, A_g = torch.randn(7, r, generator=g, dtype=torch.float64), torch.randn(r, 9, generator=g, dtype=torch.float64)
    B, A = torch.randn(7, r, generator=g, dtype=torch.float64), torch.randn(r, 9, generator=g, dtype=torch.float64)
    _, _, R_full = rotate_to(B, A, B_g, A_g, "A")
    B2, A2, R = rotate_to(B, A, B_g, A_g, "A", strength)
    torch.testing.assert_close(R.T @ R, torch.eye(r, dtype=torch.float64))
    torch.testing.assert_close(B2 @ A2, B @ A)
    # independent check: the nearest rotation to the interpolant maximises tr(R^T M) over sampled rotations
    M = (1 - strength) * torch.eye(r, dtype=torch.float64) + strength * R_full
    best = float(torch.trace(R.T @ M))
    assert all(float(torch.trace(_rotation(r, seed + s).T @ M)) <= best + 1e-9 for s in range(20))


def test_soft_rotation_endpoints():
    g = torch.Generator().manual_seed(3)
    B_g, A_g, B, A = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((6, 3), (3, 8), (6, 3), (3, 8)))
    torch.testing.assert_close(rotate_to(B, A, B_g, A_g, "B", 0.0)[2], torch.eye(3, dtype=torch.float64))
    torch.testing.assert_close(rotate_to(B, A, B_g, A_g, "B", 1.0)[2], rotate_to(B, A, B_g, A_g, "B")[2])
    with pytest.raises(ValueError, match="rotation strength"):
        rotate_to(B, A, B_g, A_g, "B", 1.5)
