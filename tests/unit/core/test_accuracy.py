"""Reconstruction at the float floor: the excess over the optimal tail ``||M - B_g A_g|| / ||M - M_R|| - 1``
against a float64 dense SVD, on the case families where float32 Householder QR lost digits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa import reconstruct, reconstruct_adapter
from fs_fedpa.core.accuracy import FAMILIES, _aggregate, case, float32_floor, tail_excess
from fs_fedpa.core.factored_svd import reconstruct_cat
from fs_fedpa.core.reconstruct import weighted_stack

EPS64 = torch.finfo(torch.float64).eps
shapes = st.tuples(st.sampled_from(FAMILIES), st.integers(0, 10**6), st.integers(3, 8), st.integers(24, 96),
                   st.integers(24, 96), st.sampled_from([2, 4]), st.integers(1, 4))  # fmt: skip


def _case(family, seed, n, d, k, r):
    Bs, As = case(family, seed, n=n, d=d, k=k, r=r)
    return [B.float() for B in Bs], [A.float() for A in As]  # float32 uploads, as a GPU client sends


@settings(max_examples=60, deadline=None)
@given(shapes, st.lists(st.floats(0.1, 10), min_size=8, max_size=8))
def test_float32_uploads_reach_the_float32_floor(spec, w):
    family, seed, n, d, k, r, rank = spec
    Bs, As = _case(family, seed, n, d, k, r)
    weights = w[:n]
    B_g, A_g = reconstruct(Bs, As, rank, weights=weights)
    exact = ([B.double() for B in Bs], [A.double() for A in As])  # the uploads themselves are exact in float64
    floor = float32_floor(*exact, rank, weights)
    excess = tail_excess(*exact, B_g, A_g, rank, weights)
    assert B_g.dtype == torch.float32 and excess <= 2 * max(floor, 0.0) + 1e-6, (family, excess, floor)


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_float64_uploads_are_exact_to_the_float64_floor(spec):
    family, seed, n, d, k, r, rank = spec
    Bs, As = case(family, seed, n=n, d=d, k=k, r=r)
    B_g, A_g = reconstruct(Bs, As, rank)
    tail = float(torch.linalg.svdvals(_aggregate(Bs, As, [1.0] * n))[rank:].square().sum().sqrt())
    # The float64 floor: 100 ulps of the terms summed, mean_i ||B_i|| ||A_i||, against the tail (itself rounding where
    # rank(M) <= rank). Not ||M||: where clients cancel, M's own rounding is that of its terms (measured worst over
    # 1500 draws: 1.8 such ulps in every family, but 2000 ulps of ||M|| for ``cancelling``).
    terms = sum(float(B.norm() * A.norm()) for B, A in zip(Bs, As)) / n
    assert abs(tail_excess(Bs, As, B_g, A_g, rank)) <= 1e-10 + 100 * EPS64 * terms / tail, family


@pytest.mark.parametrize("family", ["shared_A_1e-6", "shared_AB_1e-3"])
def test_float32_householder_misses_the_floor_on_nearly_parallel_clients(family):
    """The cases the float64 Gram route exists for: the float32 Householder route (the former ``reduced``) is
    hundreds of times the floor there, so the test above can tell the two apart."""
    Bs, As = _case(family, 0, 10, 256, 256, 4)
    w = [0.1] * 10
    B_g, A_g, _ = reconstruct_cat(*weighted_stack(Bs, As, w, torch.float32), 4, "reduced", 8, None)
    exact = ([B.double() for B in Bs], [A.double() for A in As])
    floor = float32_floor(*exact, 4)
    assert tail_excess(*exact, B_g, A_g, 4) > 20 * floor > 0
    B_g, A_g = reconstruct(Bs, As, 4, weights=w)
    assert tail_excess(*exact, B_g, A_g, 4) <= 2 * floor


def test_half_precision_uploads_are_computed_in_float64_and_returned_in_their_dtype():
    Bs, As = _case("shared_A_1e-3", 1, 6, 64, 48, 4)
    for dtype in (torch.float16, torch.bfloat16):
        low = ([B.to(dtype) for B in Bs], [A.to(dtype) for A in As])
        B_g, A_g = reconstruct(*low, 3)
        exact = ([B.double() for B in low[0]], [A.double() for A in low[1]])
        U, S, Vh = torch.linalg.svd(_aggregate(*exact, [1.0] * 6), full_matrices=False)
        rounded = tail_excess(*exact, (U[:, :3] * S[:3]).to(dtype), Vh[:3].to(dtype), 3)
        assert B_g.dtype == dtype and tail_excess(*exact, B_g, A_g, 3) <= 2 * rounded + 1e-3


def test_a_float16_aggregate_that_does_not_fit_float16_is_refused_with_the_reason():
    Bs = [torch.full((64, 4), 200.0, dtype=torch.float16) for _ in range(3)]
    As = [torch.full((4, 64), 200.0, dtype=torch.float16) for _ in range(3)]  # products of 160000 per entry
    assert all(torch.isfinite(t).all() for t in Bs + As)
    with pytest.raises(ValueError, match=r"do not fit in torch.float16 .*largest representable 6.55e\+04"):
        reconstruct(Bs, As, 2)
    B_g, A_g = reconstruct([B.float() for B in Bs], [A.float() for A in As], 2)  # float32 holds it
    assert torch.isfinite(B_g).all() and float(B_g.abs().max()) > 65504


def test_a_float16_aggregate_with_sigma_1_above_the_float16_maximum_but_small_entries_is_returned():
    # the aggregate is 16 everywhere: sigma_1 = 16 d = 65536 is above float16's 65504, B_g's entries sigma_1 / sqrt(d)
    # = 1024 are not
    d = 4096
    Bs = [torch.full((d, 1), 4.0, dtype=torch.float16) for _ in range(2)]
    As = [torch.full((1, d), 4.0, dtype=torch.float16) for _ in range(2)]
    B_g, A_g, S = reconstruct(Bs, As, 1, return_spectrum=True)
    assert float(S[0]) > 65504  # the bound on the entries does not hold here: the entries are checked one by one
    exact = torch.full((d, d), 16.0, dtype=torch.float64)
    assert torch.isfinite(B_g).all() and B_g.dtype == torch.float16
    torch.testing.assert_close(B_g.double() @ A_g.double(), exact, rtol=2e-3, atol=0)


def test_reused_workspaces_never_alias_a_returned_result():
    first = _case("random", 1, 4, 40, 32, 4)
    second = _case("norms", 2, 4, 40, 32, 4)
    B1, A1 = reconstruct(*first, 3)
    kept = (B1.clone(), A1.clone())
    B2, A2 = reconstruct(*second, 3)  # same shapes: the same float64 workspaces
    assert torch.equal(B1, kept[0]) and torch.equal(A1, kept[1])
    again = reconstruct(*first, 3)  # and the same result again
    assert torch.equal(again[0], kept[0]) and torch.equal(again[1], kept[1])


def test_an_adapters_reused_stacks_never_alias_its_uploads_or_a_returned_result():
    """Equal ranks: reconstruct_adapter stacks the uploads into workspaces kept across calls, in their own dtype and
    in float64. A second adapter of the same shapes must leave the first call's results and uploads untouched, and
    every module must equal its own reconstruction."""

    def adapter(family, seed):
        per_module = [_case(family, seed + j, 4, 40, 32, 3) for j in range(3)]
        return [{f"m{j}": (Bs[i], As[i]) for j, (Bs, As) in enumerate(per_module)} for i in range(4)]

    first, second = adapter("random", 1), adapter("norms", 7)
    copies = [{m: (B.clone(), A.clone()) for m, (B, A) in u.items()} for u in first]
    out1 = reconstruct_adapter(first, 2)
    kept = {m: (B.clone(), A.clone()) for m, (B, A) in out1.items()}
    out2 = reconstruct_adapter(second, 2)  # same shapes: the same workspaces
    for m in kept:
        assert torch.equal(out1[m][0], kept[m][0]) and torch.equal(out1[m][1], kept[m][1])
        assert all(torch.equal(u[m][0], c[m][0]) and torch.equal(u[m][1], c[m][1]) for u, c in zip(first, copies))
        alone = reconstruct([u[m][0] for u in second], [u[m][1] for u in second], 2)
        torch.testing.assert_close(out2[m][0] @ out2[m][1], alone[0] @ alone[1], rtol=1e-5, atol=1e-6)
