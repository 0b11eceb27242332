"""product_penalty and the factor-wise ablations against the dense formula and its autograd gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa import factor_penalty, product_penalty, regularizer


def _factors(seed, d, k, r, R, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(d, r), mk(r, k), mk(d, R), mk(R, k)


def _dense_value_and_grads(B, A, B_ref, A_ref):
    """Independent reference: autograd through the dense (d, k) product in float64."""
    B = B.detach().double().requires_grad_()
    A = A.detach().double().requires_grad_()
    value = (B @ A - B_ref.double() @ A_ref.double()).pow(2).sum()
    value.backward()
    return value.detach(), B.grad, A.grad


@settings(max_examples=80, deadline=None)
@given(
    d=st.integers(1, 64),
    k=st.integers(1, 64),
    r=st.integers(1, 8),
    R=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
    same=st.booleans(),
)
def test_product_penalty_equals_dense_formula_and_its_gradients(d, k, r, R, seed, same):
    # Prepare (same: the reference is the local product itself, the penalty's minimum)
    B, A, B_ref, A_ref = _factors(seed, d, k, r, R)
    if same:
        B_ref, A_ref = B.clone(), A.clone()
    B.requires_grad_()
    A.requires_grad_()
    # Execute
    value = product_penalty(B, A, B_ref, A_ref)
    value.backward()
    # Assert
    ref_value, ref_gB, ref_gA = _dense_value_and_grads(B, A, B_ref, A_ref)
    scale = float((B.detach() @ A.detach()).norm() ** 2 + (B_ref @ A_ref).norm() ** 2) + 1.0
    assert value.ndim == 0
    assert abs(float(value.detach()) - float(ref_value)) <= 1e-10 * scale
    gscale = float(ref_gB.abs().max() + ref_gA.abs().max()) + 1.0
    torch.testing.assert_close(B.grad, ref_gB, atol=1e-10 * gscale, rtol=1e-9)
    torch.testing.assert_close(A.grad, ref_gA, atol=1e-10 * gscale, rtol=1e-9)


def test_product_penalty_float32_matches_dense_float64():
    B, A, B_ref, A_ref = _factors(1, 256, 192, 4, 8, dtype=torch.float32)
    B.requires_grad_()
    A.requires_grad_()
    product_penalty(B, A, B_ref, A_ref).backward()
    ref_value, ref_gB, ref_gA = _dense_value_and_grads(B, A, B_ref, A_ref)
    torch.testing.assert_close(product_penalty(B, A, B_ref, A_ref).double(), ref_value, rtol=1e-5, atol=0)
    torch.testing.assert_close(B.grad.double(), ref_gB, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(A.grad.double(), ref_gA, rtol=1e-4, atol=1e-3)


def test_reference_is_a_constant():
    B, A, B_ref, A_ref = _factors(2, 10, 12, 3, 2)
    for t in (B, A, B_ref, A_ref):
        t.requires_grad_()
    product_penalty(B, A, B_ref, A_ref).backward()
    assert B_ref.grad is None and A_ref.grad is None
    assert B.grad is not None and A.grad is not None


def test_half_precision_factors_give_a_float32_penalty_and_half_gradients():
    B, A, B_ref, A_ref = _factors(3, 32, 16, 4, 4, dtype=torch.bfloat16)
    B.requires_grad_()
    A.requires_grad_()
    value = product_penalty(B, A, B_ref, A_ref)
    value.backward()
    assert value.dtype == torch.float32
    assert B.grad.dtype == torch.bfloat16
    ref_value, _, _ = _dense_value_and_grads(B, A, B_ref, A_ref)
    torch.testing.assert_close(value.double(), ref_value, rtol=1e-5, atol=1e-5)


def test_batched_layers_give_one_value_per_layer():
    layers = [_factors(s, 20, 10, 3, 2) for s in range(4)]
    stacked = [torch.stack([layer[j] for layer in layers]) for j in range(4)]
    values = product_penalty(*stacked)
    assert values.shape == (4,)
    for j, layer in enumerate(layers):
        torch.testing.assert_close(values[j], product_penalty(*layer))


@pytest.mark.parametrize("which", ["b", "a", "both"])
def test_factor_penalties_equal_their_dense_formulas_and_gradients(which):
    B, A, B_ref, A_ref = _factors(4, 30, 20, 4, 4)
    B.requires_grad_()
    A.requires_grad_()
    value = factor_penalty(B, A, B_ref, A_ref, which)
    value.backward()
    b = (B - B_ref).pow(2).sum()
    a = (A - A_ref).pow(2).sum()
    expected = {"b": b, "a": a, "both": a + b}[which]
    torch.testing.assert_close(value, expected)
    gB = 2 * (B - B_ref).detach() if which in ("b", "both") else torch.zeros_like(B)
    gA = 2 * (A - A_ref).detach() if which in ("a", "both") else torch.zeros_like(A)
    torch.testing.assert_close(B.grad if B.grad is not None else torch.zeros_like(B), gB)
    torch.testing.assert_close(A.grad if A.grad is not None else torch.zeros_like(A), gA)


def test_regularizer_dispatch():
    B, A, B_ref, A_ref = _factors(5, 12, 9, 3, 3)
    assert regularizer("none", B, A, B_ref, A_ref) is None
    torch.testing.assert_close(regularizer("product", B, A, B_ref, A_ref), product_penalty(B, A, B_ref, A_ref))
    torch.testing.assert_close(regularizer("both", B, A, B_ref, A_ref), factor_penalty(B, A, B_ref, A_ref, "both"))
    with pytest.raises(ValueError, match=r"reg\(='l2'\) must be one of"):
        regularizer("l2", B, A, B_ref, A_ref)


def test_factor_penalty_needs_the_local_rank():
    B, A, B_ref, A_ref = _factors(6, 12, 9, 4, 2)
    with pytest.raises(ValueError, match=r"factor-wise regularizer 'b' needs a reference of the local rank"):
        factor_penalty(B, A, B_ref, A_ref, "b")
    with pytest.raises(ValueError, match=r"which\(='ab'\) must be"):
        factor_penalty(B, A, B, A, "ab")


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((5, 3), (2, 4), (5, 2), (2, 4)), r"B has 3 columns but A has 2 rows"),
        (((5, 3), (3, 4), (5, 2), (3, 4)), r"B_ref has 2 columns but A_ref has 3 rows"),
        (((5, 3), (3, 4), (6, 2), (2, 4)), r"products differ in shape: B A is 5x4 but B_ref A_ref is 6x4"),
        (((5,), (3, 4), (5, 2), (2, 4)), r"at least 2 dims"),
    ],
)
def test_product_penalty_shape_errors(shapes, match):
    tensors = [torch.randn(*s) for s in shapes]
    with pytest.raises(ValueError, match=match):
        product_penalty(*tensors)
