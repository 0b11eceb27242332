"""The Gaussian mechanisms of fs_fedpa.privacy.mechanism against dense computations, and the accountant against dp-accounting
composing the run itself and against the Gaussian's RDP by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa.privacy.mechanism import (
    clip_scale,
    dp_generator,
    release_changes,
    release_products,
    release_shared,
    sample_without_replacement,
    shared_changes,
)

SETTINGS = settings(max_examples=40, deadline=None)


def _uploads(seed: int, n: int, shapes: dict, rank: int, scale: float = 1.0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{name: (scale * torch.randn(d, rank, generator=g), torch.randn(rank, k, generator=g))
             for name, (d, k) in shapes.items()} for _ in range(n)]  # fmt: skip


@st.composite
def rounds(draw):
    shapes = {f"m{j}": (draw(st.integers(1, 12)), draw(st.integers(1, 12))) for j in range(draw(st.integers(1, 3)))}
    n = draw(st.integers(0, 5))
    K = draw(st.integers(max(n, 1), 8))
    return shapes, n, K, draw(st.integers(1, 4)), draw(st.floats(0.01, 10.0)), draw(st.integers(0, 2**31 - 1))


@SETTINGS
@given(rounds())
def test_product_release_is_the_clipped_dense_mean(problem):
    shapes, n, K, rank, C, seed = problem
    uploads = _uploads(seed, n, shapes, rank, scale=3.0)
    release, scales = release_products(uploads, shapes, K, C, 0.0, dp_generator(0))
    for u, c in zip(uploads, scales):  # each whole update, clipped, has norm <= C (dense float64)
        norm = math.sqrt(sum(float((B.double() @ A.double()).pow(2).sum()) for B, A in u.values()))
        assert c * norm <= C * (1 + 1e-9)
        assert c == pytest.approx(min(1.0, C / norm) if norm > 0 else 1.0, rel=1e-9)
    for name, (d, k) in shapes.items():
        dense = sum((c * u[name][0].double() @ u[name][1].double() for u, c in zip(uploads, scales)),
                    torch.zeros(d, k, dtype=torch.float64)) / K  # fmt: skip
        torch.testing.assert_close(release[name].double(), dense, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(rounds())
def test_change_release_is_the_clipped_mean_change(problem):
    shapes, n, K, rank, C, seed = problem
    uploads = _uploads(seed, n, shapes, rank)
    start = _uploads(seed + 1, 1, shapes, rank)[0]
    release, scales = release_changes(uploads, [start] * max(n, 1), ("B", "A"), K, C, 0.0, dp_generator(0))
    for u, c in zip(uploads, scales):
        sq = sum(float((u[m][i].double() - start[m][i].double()).pow(2).sum()) for m in shapes for i in (0, 1))
        assert c * math.sqrt(sq) <= C * (1 + 1e-9)
    for name in shapes:
        for part, i in (("B", 0), ("A", 1)):
            expected = sum((c * (u[name][i].double() - start[name][i].double()) for u, c in zip(uploads, scales)),
                           torch.zeros_like(start[name][i], dtype=torch.float64)) / K  # fmt: skip
            torch.testing.assert_close(release[name][part].double(), expected, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(rounds(), st.booleans())
def test_a_shared_head_is_clipped_with_the_lora_update_as_one_contribution(problem, product):
    """Each client's head change joins its LoRA update in one clip (dense float64 norms here), and the released head
    is the start plus the mean of the clipped changes over K; the released sum moves by at most C / K per client."""
    shapes, n, K, rank, C, seed = problem
    uploads = _uploads(seed, n, shapes, rank, scale=3.0)
    g = torch.Generator().manual_seed(seed + 7)
    start_head = {"head.weight": torch.randn(2, 5, generator=g), "head.bias": torch.randn(2, generator=g)}
    heads = [{k: v + 2.0 * torch.randn(v.shape, generator=g) for k, v in start_head.items()} for _ in range(n)]
    changes, extra = shared_changes(heads, start_head)
    start = _uploads(seed + 1, 1, shapes, rank)[0]
    if product:
        _, scales = release_products(uploads, shapes, K, C, 0.0, dp_generator(0), extra)
    else:
        _, scales = release_changes(uploads, [start] * max(n, 1), ("B", "A"), K, C, 0.0, dp_generator(0), extra)
    new = release_shared(changes, scales, K, C, 0.0, dp_generator(0), start_head)
    expected = {k: v.double().clone() for k, v in start_head.items()}
    for u, h, c in zip(uploads, heads, scales):
        head_sq = sum(float((h[k].double() - v.double()).pow(2).sum()) for k, v in start_head.items())
        if product:
            lora_sq = sum(float((B.double() @ A.double()).pow(2).sum()) for B, A in u.values())
        else:
            lora_sq = sum(float((B.double() - start[m][0].double()).pow(2).sum() + (A.double() - start[m][1].double())
                          .pow(2).sum()) for m, (B, A) in u.items())  # fmt: skip
        norm = math.sqrt(lora_sq + head_sq)
        assert c == pytest.approx(min(1.0, C / norm), rel=1e-9) and c * norm <= C * (1 + 1e-9)
        for k, v in start_head.items():
            expected[k] += c * (h[k].double() - v.double()) / K
    for k in start_head:
        torch.testing.assert_close(new[k].double(), expected[k], rtol=1e-5, atol=1e-6)
        assert new[k].dtype == start_head[k].dtype


def test_a_shared_head_gets_noise_of_std_z_C_over_K():
    head = {"w": torch.zeros(400, 100)}
    new = release_shared([], [], 10, 0.5, 2.0, dp_generator(3), head)  # no client arrived: the noise alone
    assert float(new["w"].std()) == pytest.approx(2.0 * 0.5 / 10, rel=0.03)
    with pytest.raises(ValueError, match="shape"):
        shared_changes([{"w": torch.zeros(3)}], {"w": torch.zeros(4)})


def test_noise_std_is_z_C_over_K_on_a_large_module():
    shapes, K, C, z = {"q": (512, 512)}, 10, 2.0, 1.3
    release, _ = release_products([], shapes, K, C, z, dp_generator(5))  # nothing arrived: the noise alone
    M = release["q"].double()
    assert float(M.std()) == pytest.approx(z * C / K, rel=0.03)
    assert abs(float(M.mean())) < 3 * z * C / K / 512
    changes, _ = release_changes([], [{"q": (torch.zeros(512, 64), torch.zeros(64, 512))}], ("B",), K, C, z,
                                 dp_generator(6))  # fmt: skip
    assert float(changes["q"]["B"].double().std()) == pytest.approx(z * C / K, rel=0.03)


@SETTINGS
@given(rounds(), st.floats(0.0, 3.0))
def test_replacing_one_client_moves_the_release_by_at_most_2C_over_K(problem, z):
    """Empirical sensitivity: the same noise draw (same generator state), one client's upload replaced by its
    negation; the release moves by 2 c_j ||x_j|| / K <= 2C / K, and by exactly 2C / K when the upload is clipped."""
    shapes, n, K, rank, C, seed = problem
    if n == 0:
        return
    uploads = _uploads(seed, n, shapes, rank, scale=5.0)
    flipped = [*uploads[:-1], {m: (-B, A) for m, (B, A) in uploads[-1].items()}]
    first, scales = release_products(uploads, shapes, K, C, z, dp_generator(9))
    second, _ = release_products(flipped, shapes, K, C, z, dp_generator(9))
    move = math.sqrt(sum(float((first[m].double() - second[m].double()).pow(2).sum()) for m in shapes))
    norm = math.sqrt(sum(float((B.double() @ A.double()).pow(2).sum()) for B, A in uploads[-1].values()))
    assert move <= 2 * C / K * (1 + 1e-4) + 1e-5
    if norm > C:
        assert move == pytest.approx(2 * C / K, rel=1e-3, abs=1e-5)


def test_clip_scale_and_sampling():
    assert clip_scale(4.0, 1.0) == 0.5 and clip_scale(0.25, 1.0) == 1.0 and clip_scale(0.0, 1.0) == 1.0
    g = dp_generator(1)
    draws = [sample_without_replacement(10, 3, g) for _ in range(3000)]
    assert all(len(set(d)) == 3 and d == sorted(d) for d in draws)
    counts = torch.bincount(torch.tensor(draws).flatten(), minlength=10).double()
    assert float((counts / 3000 - 0.3).abs().max()) < 0.04  # each client in 3 of 10 rounds
    assert sample_without_replacement(4, 9, g) == [0, 1, 2, 3]


def test_dp_generator_is_os_entropy_unless_seeded():
    torch.manual_seed(0)
    a = torch.randn(4, generator=dp_generator(secure=False))
    torch.manual_seed(0)  # the run's seed does not decide it
    b = torch.randn(4, generator=dp_generator(secure=False))
    assert not torch.equal(a, b)
    assert torch.equal(torch.randn(4, generator=dp_generator(3, "s")), torch.randn(4, generator=dp_generator(3, "s")))
    assert not torch.equal(torch.randn(4, generator=dp_generator(3, "s")),
                           torch.randn(4, generator=dp_generator(3, "client 1")))  # fmt: skip


def test_without_a_seed_the_noise_and_sampling_come_from_the_cryptographic_generator(monkeypatch):
    """No MT19937 state to recover: the draws are built from os.urandom (replaced here by a counter, which must
    then decide them), the Gaussians are N(0, 1) by scipy's Kolmogorov-Smirnov test, and sampling is uniform."""
    from scipy import stats

    from fs_fedpa.privacy import mechanism as dp_module
    from fs_fedpa.privacy.mechanism import SecureGenerator, gaussian

    g = dp_generator()
    assert isinstance(g, SecureGenerator) and isinstance(dp_generator(3), torch.Generator)
    assert isinstance(dp_generator(secure=False), torch.Generator)
    x = gaussian((200, 100), 1.0, g, torch.zeros(()))
    assert x.dtype == torch.float32 and stats.kstest(x.double().flatten().numpy(), "norm").pvalue > 1e-3
    big = gaussian((400_000,), 2.5, g, torch.zeros((), dtype=torch.float64))
    assert abs(float(big.std()) - 2.5) < 0.02 and abs(float(big.mean())) < 0.02
    assert not torch.equal(gaussian((8,), 1.0, g, x), gaussian((8,), 1.0, g, x))
    draws = [sample_without_replacement(10, 3, g) for _ in range(3000)]
    assert all(len(set(d)) == 3 and d == sorted(d) for d in draws)
    counts = torch.bincount(torch.tensor(draws).flatten(), minlength=10).double()
    assert float((counts / 3000 - 0.3).abs().max()) < 0.04
    calls = []  # the bytes come from os.urandom: a fixed source gives fixed noise
    monkeypatch.setattr(dp_module.os, "urandom", lambda n: (calls.append(n), bytes(range(256)) * (n // 256 + 1))[1][:n])
    one, two = SecureGenerator().normal((3, 5)), SecureGenerator().normal((3, 5))
    assert torch.equal(one, two) and calls


# ------------------------------------------------------------------------------------------------- accountant
dpa = pytest.importorskip("dp_accounting", reason="dp-accounting (the dp extra) is not installed")


def test_all_clients_each_round_is_the_gaussians_rdp_by_hand():
    """K = N: no amplification; T rounds of noise z C / K over sensitivity 2C / K are RDP T alpha / (2 (z/2)^2)."""
    from fs_fedpa.privacy.accountant import Sampled

    z, T = 1.7, 12
    accountant = Sampled(10, 10, z).accountant(T)
    sigma = z / 2
    for order, rdp in zip(accountant._orders, accountant._rdp):
        assert rdp == pytest.approx(T * order / (2 * sigma**2), rel=1e-12)
    # epsilon by hand from those RDP values, with the conversion of Canonne, Kamath and Steinke (2020), Prop. 12
    delta = 1e-5
    by_hand = min(
        T * a / (2 * sigma**2) + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1)
        for a in accountant._orders
        if a > 1
    )
    assert Sampled(10, 10, z).epsilon(T, delta) == pytest.approx(by_hand, rel=1e-6)


@pytest.mark.parametrize(("N", "K", "z", "T", "by_round"), [(10, 3, 0.8, 7, True), (100, 10, 1.0, 30, False),
                                                           (6700, 16, 1.1, 210, False)])  # fmt: skip
def test_ledger_route_equals_dp_accounting_composing_the_run(N, K, z, T, by_round):
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    from fs_fedpa.privacy.accountant import Sampled

    accountant = rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    event = dpa.SampledWithoutReplacementDpEvent(N, K, dpa.GaussianDpEvent(z / 2))
    if by_round:  # as a run composes them (each compose recomputes the event's RDP: slow for long runs)
        for _ in range(T):
            accountant.compose(event)
    else:
        accountant.compose(dpa.SelfComposedDpEvent(event, T))
    assert Sampled(N, K, z).epsilon(T, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


def test_replace_one_costs_the_z_over_2_of_the_issue():
    from fs_fedpa.privacy.accountant import Sampled

    assert Sampled(100, 10, 1.0).epsilon(30, 1e-5) == pytest.approx(32.27, abs=0.05)  # not 7.6, which z gives


def test_calibrate_meets_the_target_tightly():
    from fs_fedpa.privacy.accountant import Sampled, calibrate

    z = calibrate(100, 10, 30, 8.0, 1e-5)
    assert Sampled(100, 10, z).epsilon(30, 1e-5) <= 8.0
    assert Sampled(100, 10, z * 0.99).epsilon(30, 1e-5) > 8.0


# ---------------------------------------------------------------------------------------- DP-SGD's flat noise draw
@SETTINGS
@given(st.lists(st.integers(0, 40), min_size=0, max_size=8), st.integers(0, 2**31 - 1), st.floats(0.0, 5.0))
def test_the_flat_noise_is_the_per_tensor_draws_of_the_same_stream(sizes, seed, std):
    """gaussian_flat (DP-SGD's step: one buffer, one copy to the device) takes from a seeded generator the very
    numbers that gaussian draws tensor by tensor, in order (sizes below, at and above the 16 of torch's vectorized
    normal fill), so a seeded or resumed run draws what it drew before, and leaves the generator where they do."""
    from fs_fedpa.privacy.mechanism import gaussian, gaussian_flat

    like = torch.zeros((), dtype=torch.float64)
    one, two = dp_generator(seed, "flat"), dp_generator(seed, "flat")
    flat = gaussian_flat(sizes, std, one, like)
    apart = [gaussian((n,), std, two, like) for n in sizes]
    assert flat.shape == (sum(sizes),) and flat.dtype == torch.float64
    assert torch.equal(flat, torch.cat(apart) if apart else torch.zeros(0, dtype=torch.float64))
    assert torch.equal(torch.randn(3, generator=one), torch.randn(3, generator=two))  # the same state after
    assert gaussian_flat(sizes, std, dp_generator(seed), torch.zeros((), dtype=torch.float16)).dtype == torch.float16


def test_the_flat_noise_from_the_secure_generator_is_n_0_std():
    from scipy import stats

    from fs_fedpa.privacy.mechanism import SecureGenerator, gaussian_flat

    x = gaussian_flat([3, 0, 20_000, 7], 2.0, SecureGenerator(), torch.zeros(()))
    assert x.shape == (20_010,) and x.dtype == torch.float32
    assert stats.kstest((x.double() / 2.0).numpy(), "norm").pvalue > 1e-3
