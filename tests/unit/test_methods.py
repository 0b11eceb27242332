"""Every federated method against the shared contract, and each method's defining server rule."""

from __future__ import annotations

import pytest
import torch

from fs_fedpa.config import FedPAConfig
from fs_fedpa.core.ranks import RankPlan
from fs_fedpa.methods import METHODS, get_method
from fs_fedpa.plugin.config import PLUGIN_METHODS
from tests.factories import dense_aggregate, optimal_error

SHAPES = {"q": (12, 10), "v": (12, 8)}


def _uploads(ranks, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            n: (
                torch.randn(d, r, generator=g, dtype=torch.float64),
                torch.randn(r, k, generator=g, dtype=torch.float64),
            )
            for n, (d, k) in SHAPES.items()
        }
        for r in ranks
    ]


def _method(name, ranks, reference_ranks=None):
    get_method(name)  # registers every method
    plan = RankPlan.build(len(ranks), max(ranks), client_ranks=ranks, reference_ranks=reference_ranks)
    return METHODS[name](FedPAConfig(), plan)


def test_the_fs_registration_lists_every_method():
    get_method("fedpa")
    assert tuple(sorted(METHODS)) == PLUGIN_METHODS


@pytest.mark.parametrize("name", PLUGIN_METHODS)
def test_contract_ranks_of_init_downlink_and_aggregate(name):
    # Prepare
    method = _method(name, [4, 4, 4], reference_ranks=[2, 3, 4])
    gen = torch.Generator().manual_seed(0)
    init = method.init_global(SHAPES, gen)
    # Execute
    client = method.client_init(init, 1)
    uploads = _uploads([4, 4, 4])
    if name == "ffa_lora":  # its clients never change their shared, frozen A
        uploads = [{n: (B, uploads[0][n][1]) for n, (B, _) in u.items()} for u in uploads]
    global_, _ = method.aggregate(uploads, [1.0, 2.0, 3.0], [1, 2, 3], gen)
    down = method.downlink(global_, 0)
    # Assert
    assert all(B.shape[1] == 4 and A.shape[0] == 4 for B, A in client.values())
    assert all(B.shape == (SHAPES[n][0], 4) and A.shape == (4, SHAPES[n][1]) for n, (B, A) in global_.items())
    assert all(B.shape[1] == 2 for B, _ in down.values())  # R_1 = 2


def test_fedit_averages_each_factor():
    uploads, w = _uploads([3, 3]), [1.0, 3.0]
    global_, _ = _method("fedit", [3, 3]).aggregate(uploads, w, [1, 2], torch.Generator())
    for n, (B, A) in global_.items():
        torch.testing.assert_close(B, 0.25 * uploads[0][n][0] + 0.75 * uploads[1][n][0])
        torch.testing.assert_close(A, 0.25 * uploads[0][n][1] + 0.75 * uploads[1][n][1])


def test_ffa_lora_keeps_the_frozen_A_exactly_and_rejects_a_changed_one():
    uploads = _uploads([3, 3])
    shared = [{n: (B, uploads[0][n][1]) for n, (B, _) in u.items()} for u in uploads]
    global_, _ = _method("ffa_lora", [3, 3]).aggregate(shared, [1.0, 2.0], [1, 2], torch.Generator())
    assert all(torch.equal(A, uploads[0][n][1]) for n, (_, A) in global_.items())
    with pytest.raises(ValueError, match="FFA-LoRA clients uploaded different A; A must stay frozen"):
        _method("ffa_lora", [3, 3]).aggregate(uploads, [1.0, 2.0], [1, 2], torch.Generator())


def test_fedit_refuses_heterogeneous_ranks():
    with pytest.raises(ValueError, match=r"fedit averages factors, so every client needs the same rank"):
        _method("fedit", [2, 4])


@pytest.mark.parametrize("name", ["flexlora", "fedpa"])
def test_product_space_methods_reach_the_svd_optimum_with_heterogeneous_ranks(name):
    uploads, w = _uploads([2, 3, 5]), [1.0, 1.0, 2.0]
    method = _method(name, [2, 3, 5])
    global_, _ = method.aggregate(uploads, w, [1, 2, 3], torch.Generator())
    for n, (B, A) in global_.items():
        X = dense_aggregate([u[n][0] for u in uploads], [u[n][1] for u in uploads], w)
        assert float(torch.linalg.matrix_norm(X - B @ A)) == pytest.approx(optimal_error(X, 5), abs=1e-9)


def test_what_each_method_keeps_trains_and_aligns():
    local = {n: (B.requires_grad_(), A.requires_grad_()) for n, (B, A) in _uploads([2])[0].items()}
    reference = _uploads([2], seed=1)[0]
    keeps = {"fedpa": (True, True), "fedsa_lora": (True, False)}
    trains = {"ffa_lora": [(True, False)] * 2, "rolora": [(True, False), (False, True)]}
    for name in PLUGIN_METHODS:
        method = _method(name, [2])
        assert method.keeps == keeps.get(name, (False, False)), name
        assert [method.trainable(0), method.trainable(1)] == trains.get(name, [(True, True)] * 2), name
        aligns = name in ("fedpa", "fedpa_no_preservation")
        assert (method.alignment(local, reference, 1.0) is not None) is aligns, name


def test_fedrot_rotation_keeps_each_product_and_moves_factors_toward_the_global():
    method = _method("fedrot_lora", [3, 3])
    local, received = _uploads([3])[0], _uploads([3], seed=5)[0]
    for rnd, factor in ((0, 1), (1, 0)):  # A aligned in even rounds, B in odd ones
        rotated = method.before_upload(local, received, rnd)
        for n, (B, A) in rotated.items():
            torch.testing.assert_close(B @ A, local[n][0] @ local[n][1])
            before = torch.linalg.matrix_norm(local[n][factor] - received[n][factor])
            assert torch.linalg.matrix_norm((B, A)[factor] - received[n][factor]) <= before


def test_hetlora_pads_averages_and_truncates_back():
    uploads, w = _uploads([2, 4]), [1.0, 1.0]
    method = _method("hetlora", [2, 4])
    global_, _ = method.aggregate(uploads, w, [1, 2], torch.Generator())
    for n, (B, A) in global_.items():
        assert B.shape[1] == 4 and A.shape[0] == 4
        torch.testing.assert_close(B[:, :2], 0.5 * (uploads[0][n][0] + uploads[1][n][0][:, :2]))
        torch.testing.assert_close(B[:, 2:], 0.5 * uploads[1][n][0][:, 2:])  # the rank-2 client padded zeros
        torch.testing.assert_close(A[2:], 0.5 * uploads[1][n][1][2:])
    start = method.start_round(global_, 0)
    assert all(B.shape[1] == 2 and A.shape[0] == 2 for B, A in start.values())
