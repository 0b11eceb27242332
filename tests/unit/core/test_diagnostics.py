"""E_agg, E_init and the aggregate spectrum against dense float64 computations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa import aggregate_spectrum, aggregation_error, factored_norm, initialization_error, reconstruct
from tests.factories import client_factors, dense_aggregate, optimal_error


@settings(max_examples=60, deadline=None)
@given(
    d=st.integers(1, 48),
    k=st.integers(1, 48),
    ranks=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    R=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_aggregation_error_of_any_global_factors_equals_the_dense_norm(d, k, ranks, R, seed):
    # Prepare: arbitrary global factors (as FedIT or a stale global would have)
    Bs, As = client_factors(seed, d, k, ranks)
    g = torch.Generator().manual_seed(seed + 1)
    B_g = torch.randn(d, R, generator=g, dtype=torch.float64)
    A_g = torch.randn(R, k, generator=g, dtype=torch.float64)
    weights = [1.0 + i for i in range(len(ranks))]
    # Execute
    err = aggregation_error(Bs, As, B_g, A_g, weights=weights)
    rel = aggregation_error(Bs, As, B_g, A_g, weights=weights, relative=True)
    # Assert
    X = dense_aggregate(Bs, As, weights)
    dense = torch.linalg.matrix_norm(B_g @ A_g - X)
    torch.testing.assert_close(err, dense, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(rel, dense / torch.linalg.matrix_norm(X), rtol=1e-9, atol=1e-12)


def test_aggregation_error_of_the_reconstruction_is_the_spectral_tail():
    Bs, As = client_factors(3, 64, 48, [4, 4, 4, 4])
    B_g, A_g, S = reconstruct(Bs, As, 6, return_spectrum=True)
    torch.testing.assert_close(aggregation_error(Bs, As, B_g, A_g), S[6:].pow(2).sum().sqrt())
    assert float(aggregation_error(Bs, As, B_g, A_g)) == pytest.approx(optimal_error(dense_aggregate(Bs, As), 6))


def test_aggregation_error_is_tiny_for_an_exact_reconstruction_in_float32():
    """The QR route keeps digits that the Gram expansion tr(B^T B A A^T) would lose (sqrt(eps) ~ 3e-4)."""
    Bs, As = client_factors(4, 256, 256, [4, 4, 4], dtype=torch.float32)
    B_g, A_g = reconstruct(Bs, As, 12)
    assert float(aggregation_error(Bs, As, B_g, A_g, relative=True)) < 1e-5


def test_aggregation_error_of_fedit_averaging_is_positive():
    Bs, As = client_factors(5, 32, 32, [4, 4, 4])
    B_avg, A_avg = sum(Bs) / 3, sum(As) / 3
    dense = torch.linalg.matrix_norm(B_avg @ A_avg - dense_aggregate(Bs, As))
    torch.testing.assert_close(aggregation_error(Bs, As, B_avg, A_avg), dense)
    assert float(dense) > 0


def test_factored_norm_equals_the_dense_norm_batched():
    Bs, As = client_factors(6, 20, 30, [3])
    B = torch.stack([Bs[0], 2 * Bs[0]])
    A = torch.stack([As[0], As[0]])
    torch.testing.assert_close(factored_norm(B, A), torch.linalg.matrix_norm(B @ A))


def test_initialization_error_follows_the_papers_formula():
    g = torch.Generator().manual_seed(0)
    starts = [torch.randn(6, 2, generator=g), torch.randn(6, 4, generator=g)]
    ends = [torch.randn(6, 2, generator=g), starts[1].clone()]
    expected = (float((starts[0] - ends[0]).norm() / (starts[0].norm() + 1e-8)) + 0.0) / 2
    assert initialization_error(starts, ends) == pytest.approx(expected, rel=1e-6)
    assert initialization_error(starts, [s.clone() for s in starts]) == 0.0  # FedPA keeps its factors


def test_spectrum_helper_equals_dense_singular_values():
    Bs, As = client_factors(7, 30, 20, [2, 3])
    S = aggregate_spectrum(Bs, As, weights=[2.0, 1.0])
    torch.testing.assert_close(S, torch.linalg.svdvals(dense_aggregate(Bs, As, [2.0, 1.0]))[:5])


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: initialization_error([torch.zeros(2, 2)], []), r"need one start and one end per client, got 1 and 0"),
        (
            lambda: initialization_error([torch.zeros(2, 2)], [torch.zeros(2, 3)]),
            r"client 0: start \(2, 2\) and end \(2, 3\)",
        ),
        (lambda: initialization_error([torch.zeros(2)], [torch.zeros(2)], eps=0), r"eps\(=0\) must be > 0"),
        (lambda: factored_norm(torch.zeros(3, 2), torch.zeros(3, 3)), r"B has 2 columns but A has 3 rows"),
        (
            lambda: aggregation_error(
                [torch.full((3, 2), float("nan"))], [torch.zeros(2, 3)], torch.zeros(3, 1), torch.zeros(1, 3)
            ),
            r"client B factors contains NaN or Inf",
        ),
    ],
)
def test_diagnostics_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_product_distance_matches_the_dense_difference_at_two_ranks():
    from fs_fedpa.core.norms import product_distance

    g = torch.Generator().manual_seed(11)
    B, A = torch.randn(13, 2, generator=g, dtype=torch.float64), torch.randn(2, 9, generator=g, dtype=torch.float64)
    Br, Ar = torch.randn(13, 5, generator=g, dtype=torch.float64), torch.randn(5, 9, generator=g, dtype=torch.float64)
    want = torch.linalg.matrix_norm(B @ A - Br @ Ar)
    torch.testing.assert_close(product_distance(B, A, Br, Ar), want)
    assert float(product_distance(B, A, B.clone(), A.clone())) < 1e-12 * float(torch.linalg.matrix_norm(B @ A))


def test_gradient_split_matches_separate_autograd_of_the_task_loss_and_the_alignment_term():
    from fs_fedpa.core.diagnostics import GradientSplit
    from fs_fedpa.core.penalty import product_penalty

    # Prepare: a tiny LoRA-like model y = x (W0 + B A)^T and two optimiser steps
    g = torch.Generator().manual_seed(12)
    W0 = torch.randn(6, 5, generator=g)
    B = torch.nn.Parameter(torch.randn(6, 2, generator=g))
    A = torch.nn.Parameter(torch.randn(2, 5, generator=g))
    ref = (torch.randn(6, 3, generator=g), torch.randn(3, 5, generator=g))
    batches = [(torch.randn(8, 5, generator=g), torch.randn(8, 6, generator=g)) for _ in range(3)]
    opt = torch.optim.SGD([B, A], lr=0.05)
    split = GradientSplit()
    split.watch({"m": (B, A)})
    expected = []
    for x, y in batches:
        split.end_step()  # the previous step's backward is complete
        # the independent reference: each part's gradient by its own autograd call, at the same parameters
        task = ((x @ (W0 + B @ A).T - y) ** 2).mean()
        align = 0.5 * 0.3 * product_penalty(B, A, *ref)
        g_task = torch.autograd.grad(task, (B, A))
        g_align = torch.autograd.grad(align, (B, A))
        norm = lambda gs: float(sum(t.pow(2).sum() for t in gs)) ** 0.5  # noqa: E731
        expected.append((norm(g_align), norm(g_task)))
        split.discard()  # the reference's own autograd.grad calls reached the hooks too
        # Execute: what training does, one backward of task + term, the term read through the aliases
        (Bv, Av) = split.alias({"m": (B, A)})["m"]
        loss = ((x @ (W0 + B @ A).T - y) ** 2).mean() + 0.5 * 0.3 * product_penalty(Bv, Av, *ref)
        opt.zero_grad()
        loss.backward()
        opt.step()
    split.close()
    # Assert
    norms = split.norms()
    assert norms["first"] == pytest.approx(expected[0], rel=1e-5)
    assert norms["last"] == pytest.approx(expected[-1], rel=1e-5)
    assert not B._backward_hooks  # hooks are gone after close


def test_the_whole_update_norms_equal_the_dense_computation():
    """product_sq_norm: sum over modules of ||B A||_F^2; change_sq_norm: of ||X - X0||_F^2 over the uploaded parts (the
    quantity client-level DP clips and the diagnostics call change_norm); both against dense float64 sums."""
    import pytest

    from fs_fedpa.core.norms import change_sq_norm, product_sq_norm

    g = torch.Generator().manual_seed(5)
    now = {m: (torch.randn(7, 3, generator=g), torch.randn(3, 5, generator=g)) for m in ("q", "v")}
    start = {m: (torch.randn(7, 3, generator=g), torch.randn(3, 5, generator=g)) for m in ("q", "v")}
    dense = sum(float((B.double() @ A.double()).pow(2).sum()) for B, A in now.values())
    assert product_sq_norm(now) == pytest.approx(dense, rel=1e-6)  # float32 factors: float32 QR
    double = {m: (B.double(), A.double()) for m, (B, A) in now.items()}
    assert product_sq_norm(double) == pytest.approx(dense, rel=1e-12)
    for parts, idx in ((["B"], (0,)), (["A"], (1,)), (["B", "A"], (0, 1))):
        want = sum(float((now[m][i].double() - start[m][i].double()).pow(2).sum()) for m in now for i in idx)
        assert change_sq_norm(now, start, parts) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="q B: shape"):
        change_sq_norm({"q": (torch.zeros(7, 2), torch.zeros(2, 5))}, start, ["B"])
