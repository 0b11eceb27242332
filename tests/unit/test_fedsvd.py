"""FedSVD: the server's re-factoring of B̄ A against a dense float64 SVD, its orthonormal A, and its clients' B-only
rounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa.config import FedPAConfig
from fs_fedpa.core.ranks import RankPlan, init_global_factors
from fs_fedpa.methods import METHODS, get_method
from fs_fedpa.methods.fedsvd import refactor

SHAPES = {"q": (12, 10), "v": (12, 8)}
TIGHT = {"atol": 1e-12, "rtol": 1e-12}


def _method(ranks=(4, 4, 4)):
    get_method("fedsvd")  # registers every method
    return METHODS["fedsvd"](FedPAConfig(), RankPlan.build(len(ranks), max(ranks), client_ranks=list(ranks)))


def _orthonormal_rows(r, k, g):
    """``(r, k)`` with ``A Aᵀ = I``, float64 (r <= k)."""
    return torch.linalg.qr(torch.randn(k, r, generator=g, dtype=torch.float64))[0].T


def _assert_svd_of(B_new, A_new, S, dense, tol):
    """``B_new A_new = dense``, ``A_new`` orthonormal rows, ``B_newᵀ B_new = diag(S²)`` descending, S = the dense
    product's leading singular values (the reference: torch.linalg.svdvals of ``dense``)."""
    r = A_new.shape[0]
    torch.testing.assert_close(B_new @ A_new, dense, **tol)
    torch.testing.assert_close(A_new @ A_new.T, torch.eye(r, dtype=A_new.dtype), **tol)
    gram = B_new.T @ B_new
    squares = torch.zeros(r, dtype=S.dtype)
    squares[: S.numel()] = S**2
    torch.testing.assert_close(gram, torch.diag(squares), **tol)
    assert bool((gram.diagonal()[1:] <= gram.diagonal()[:-1] + tol["atol"]).all())  # non-increasing
    torch.testing.assert_close(S, torch.linalg.svdvals(dense)[: S.numel()], **tol)


def test_aggregate_is_the_svd_of_the_weighted_mean_of_B_times_the_common_A():
    # Prepare: the global factors the clients received (A with orthonormal rows), the B each trained
    method, g, w = _method(), torch.Generator().manual_seed(0), [1.0, 2.0, 3.0]
    global_ = {n: (torch.randn(d, 4, generator=g, dtype=torch.float64), _orthonormal_rows(4, k, g))
               for n, (d, k) in SHAPES.items()}  # fmt: skip
    trained = [{n: torch.randn(d, 4, generator=g, dtype=torch.float64) for n, (d, _) in SHAPES.items()} for _ in w]
    uploads = [method.complete_upload({n: {"B": B} for n, B in t.items()}, global_, c) for c, t in enumerate(trained)]
    # Execute
    new, spectra = method.aggregate(uploads, w, [0, 1, 2], torch.Generator())
    # Assert: against the dense (sum_i w_i B_i / sum_i w_i) A_old
    for n, (B_new, A_new) in new.items():
        dense = sum(wi * t[n] for wi, t in zip(w, trained)) / sum(w) @ global_[n][1]
        _assert_svd_of(B_new, A_new, spectra[n], dense, TIGHT)
        assert spectra[n].shape == (4,)


def test_init_global_orthonormalises_peft_s_draw_of_A_and_sets_B_to_zero():
    # Execute
    init = _method().init_global(SHAPES, torch.Generator().manual_seed(3))
    # Assert: B = 0, A A^T = I, and A spans the rows of PEFT's draw from the same stream
    draw = torch.Generator().manual_seed(3)
    for n, (B, A) in init.items():
        d, k = SHAPES[n]
        peft = init_global_factors(d, k, 4, generator=draw)[1]
        assert B.shape == (d, 4) and A.shape == (4, k) and B.dtype == A.dtype == torch.float32
        assert not bool(B.any())
        torch.testing.assert_close(A @ A.T, torch.eye(4), atol=1e-6, rtol=0)
        torch.testing.assert_close(peft @ A.T @ A, peft, atol=1e-6, rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    d=st.integers(1, 12),
    r=st.integers(1, 6),
    extra=st.integers(0, 8),
    weights=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=4),
    low_rank=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_refactor_of_a_weighted_mean_is_the_svd_of_the_product(d, r, extra, weights, low_rank, seed):
    # Prepare: k >= r so that A can have orthonormal rows; d may be below r; B may be rank one
    g = torch.Generator().manual_seed(seed)
    A = _orthonormal_rows(r, r + extra, g)
    Bs = [torch.randn(d, r, generator=g, dtype=torch.float64) for _ in weights]
    if low_rank:
        u = torch.randn(d, 1, generator=g, dtype=torch.float64)
        Bs = [u @ torch.randn(1, r, generator=g, dtype=torch.float64) for _ in weights]
    B = sum(w * Bi for w, Bi in zip(weights, Bs)) / sum(weights)
    # Execute
    B_new, A_new, S = refactor(B, A)
    # Assert
    assert B_new.shape == (d, r) and A_new.shape == (r, r + extra) and S.shape == (min(d, r),)
    _assert_svd_of(B_new, A_new, S, B @ A, {"atol": 1e-10, "rtol": 1e-10})


def test_a_round_with_nothing_learned_keeps_A_and_B_zero():
    # Prepare
    A = _orthonormal_rows(3, 7, torch.Generator().manual_seed(1))
    uploads = [{"q": (torch.zeros(5, 3, dtype=torch.float64), A)} for _ in range(2)]
    # Execute
    B_new, A_new, S = refactor(torch.zeros(5, 3, dtype=torch.float64), A)
    new, spectra = _method((3, 3)).aggregate(uploads, [1.0, 1.0], [0, 1], torch.Generator())
    # Assert
    for B_out, A_out, S_out in ((B_new, A_new, S), (*new["q"], spectra["q"])):
        assert torch.equal(A_out, A) and not bool(B_out.any()) and B_out.shape == (5, 3)
        assert torch.equal(S_out, torch.zeros(3, dtype=torch.float64))


def test_refactor_computes_in_float64_and_returns_the_input_dtype():
    g = torch.Generator().manual_seed(2)
    B, A = torch.randn(9, 4, generator=g), _orthonormal_rows(4, 6, g).float()
    B_new, A_new, S = refactor(B, A)
    assert B_new.dtype == A_new.dtype == S.dtype == torch.float32
    _assert_svd_of(B_new.double(), A_new.double(), S.double(), B.double() @ A.double(), {"atol": 1e-5, "rtol": 1e-5})


@pytest.mark.parametrize(
    ("B", "A", "message"),
    [
        (torch.ones(3, 2), torch.ones(3, 4), r"needs B \(d, r\) and A \(r, k\); got B \(3, 2\) and A \(3, 4\)"),
        (torch.full((3, 2), float("nan")), torch.ones(2, 4), "B contains NaN or Inf"),
    ],
)
def test_refactor_refuses_mismatched_or_non_finite_factors(B, A, message):
    with pytest.raises(ValueError, match=message):
        refactor(B, A)


def test_clients_train_and_send_B_only_and_the_server_completes_with_the_global_A():
    # Prepare
    method, g = _method(), torch.Generator().manual_seed(4)
    global_ = method.init_global(SHAPES, g)
    own = {n: (torch.randn(B.shape, generator=g), A) for n, (B, A) in global_.items()}  # B trained, A as received
    # Execute
    start = method.start_round(global_, own, 1, 1)
    payload = method.upload_payload(own, 1, 1)
    completed = method.complete_upload(payload, global_, 1, 1)
    # Assert: A is trained by nobody, travels nowhere, and is the global one bit for bit
    assert [method.trainable(0), method.trainable(1)] == [(True, False)] * 2
    assert method.upload_parts(0) == method.upload_parts(1) == ("B",)
    assert all(set(parts) == {"B"} for parts in payload.values())
    for n, (B, A) in completed.items():
        assert torch.equal(A, global_[n][1]) and torch.equal(B, own[n][0])
        assert torch.equal(start[n][1], global_[n][1])
