"""One lambda for every client: the alignment term is lam/(2 s^2) ||Delta W_i - X_g,i||_F^2 in the applied space,
whatever the client's rank r_i, with s the scaling of the configured adapter rank (so homogeneous runs are unchanged).
"""

from __future__ import annotations

import pytest
import torch

from fs_fedpa.config import FedPAConfig
from fs_fedpa.core.penalty import product_penalty
from fs_fedpa.core.ranks import RankPlan
from fs_fedpa.lora import ClientSpace, Scaling
from fs_fedpa.methods import get_method

ALPHA, ADAPTER_RANK, LAM = 8.0, 4, 0.7
D, K = 9, 7


def _scaling(rslora=False):
    return Scaling({"q": ALPHA}, {"q": rslora})


def _s(r, rslora=False):
    return ALPHA / r**0.5 if rslora else ALPHA / r


def _term(r_i, own, X, rslora=False):
    """What a FedPA client of rank r_i adds to its loss: the method's alignment in the client's space."""
    space = ClientSpace(_scaling(rslora), r_i)
    plan = RankPlan.build(2, ADAPTER_RANK, client_ranks=[r_i, ADAPTER_RANK])
    method = get_method("fedpa")(FedPAConfig(lam=LAM), plan)
    weight = space.penalty_weight(plan.lam_rank)
    _, reference = space.into_model({}, {"q": X})  # the reference in the frame of the model's factors
    return method.alignment({"q": own}, reference, LAM * weight)


def _same_update_at_rank(delta_W, r_i, rslora=False, seed=0):
    """Raw factors (B_i, A_i) of rank r_i with s_i B_i A_i = delta_W (rank <= 2 < r_i)."""
    g = torch.Generator().manual_seed(seed)
    U, S, Vh = torch.linalg.svd(delta_W)
    mix = torch.linalg.qr(torch.randn(r_i, r_i, generator=g, dtype=torch.float64)).Q  # any rotation of the factors
    B = torch.zeros(D, r_i, dtype=torch.float64)
    A = torch.zeros(r_i, K, dtype=torch.float64)
    B[:, :2] = U[:, :2] * S[:2] / _s(r_i, rslora)
    A[:2] = Vh[:2]
    return (B @ mix).requires_grad_(), (mix.T @ A).requires_grad_()


@pytest.mark.parametrize("rslora", [False, True])
def test_clients_of_different_ranks_with_the_same_update_pay_the_same_penalty(rslora):
    # Prepare: one applied update of rank 2, held by clients of ranks 2, 4 and 16; one applied reference of rank 3
    g = torch.Generator().manual_seed(1)
    delta_W = torch.randn(D, 2, generator=g, dtype=torch.float64) @ torch.randn(2, K, generator=g, dtype=torch.float64)
    X = (torch.randn(D, 3, generator=g, dtype=torch.float64), torch.randn(3, K, generator=g, dtype=torch.float64))
    # Independent reference: lam / (2 s^2) ||Delta W - X||_F^2 on dense matrices, s = s(adapter rank)
    expected = LAM / (2 * _s(ADAPTER_RANK, rslora) ** 2) * (delta_W - X[0] @ X[1]).pow(2).sum()
    for r_i in (2, 4, 16):
        B, A = _same_update_at_rank(delta_W, r_i, rslora)
        # Execute
        term = _term(r_i, (B, A), X, rslora)
        # Assert
        torch.testing.assert_close(term, expected, rtol=1e-10, atol=0)


@pytest.mark.parametrize("r_i", [2, 4, 16])
def test_the_gradient_is_that_of_one_common_lambda_on_the_applied_update(r_i):
    # Prepare
    g = torch.Generator().manual_seed(r_i)
    B = torch.randn(D, r_i, generator=g, dtype=torch.float64, requires_grad=True)
    A = torch.randn(r_i, K, generator=g, dtype=torch.float64, requires_grad=True)
    X = (torch.randn(D, 3, generator=g, dtype=torch.float64), torch.randn(3, K, generator=g, dtype=torch.float64))
    # Execute
    grads = torch.autograd.grad(_term(r_i, (B, A), X), (B, A))
    # Assert: autograd through the dense applied product with one lam for everybody
    dense = LAM / (2 * _s(ADAPTER_RANK) ** 2) * (_s(r_i) * B @ A - X[0] @ X[1]).pow(2).sum()
    for got, want in zip(grads, torch.autograd.grad(dense, (B, A))):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # and on the applied product itself the gradient does not depend on r_i: d/d(Delta W) = lam/s^2 (Delta W - X)
    gB_applied = grads[0] / _s(r_i)  # dL/dB_i = s_i dL/d(Delta W) A_i^T
    torch.testing.assert_close(
        gB_applied, LAM / _s(ADAPTER_RANK) ** 2 * (_s(r_i) * B @ A - X[0] @ X[1]).detach() @ A.detach().T
    )


def test_a_homogeneous_run_keeps_the_previous_releases_value_bit_for_bit():
    # The previous release added lam/2 ||B A - (B_ref / s) A_ref||^2 with s the client's live scaling.
    g = torch.Generator().manual_seed(3)
    B = torch.randn(D, ADAPTER_RANK, generator=g)
    A = torch.randn(ADAPTER_RANK, K, generator=g)
    X = (torch.randn(D, ADAPTER_RANK, generator=g), torch.randn(ADAPTER_RANK, K, generator=g))
    previous = 0.5 * LAM * torch.stack([product_penalty(B, A, X[0] / _s(ADAPTER_RANK), X[1])]).sum()
    now = _term(ADAPTER_RANK, (B, A), X)
    assert ClientSpace(_scaling(), ADAPTER_RANK).penalty_weight(ADAPTER_RANK) == 1.0
    assert torch.equal(now, previous)
    assert float(now) == 78.32916259765625  # what the previous release (d0548ce) computed on this case
