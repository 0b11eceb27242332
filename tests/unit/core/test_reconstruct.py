"""fs_fedpa.reconstruct against an independent dense float64 SVD (Eckart-Young), plus its input checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa import reconstruct, reconstruct_adapter
from fs_fedpa.core.accuracy import float32_floor, tail_excess
from tests.factories import KINDS, client_factors, dense_aggregate, optimal_error

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def problems(draw, max_dim: int = 64, max_clients: int = 6, max_rank: int = 8):
    d = draw(st.integers(1, max_dim))
    k = draw(st.integers(1, max_dim))
    n = draw(st.integers(1, max_clients))
    ranks = draw(st.lists(st.integers(1, max_rank), min_size=n, max_size=n))
    weights = draw(st.none() | st.lists(st.floats(0.05, 10.0), min_size=n, max_size=n))
    rank = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(KINDS))
    seed = draw(st.integers(0, 2**31 - 1))
    return d, k, ranks, weights, rank, kind, seed


def excess_error(Bs, As, weights, B_g, A_g, rank):
    """(||X - B_g A_g|| - min_rank ||X - Y||) / scale, with X and the optimum from a dense float64 SVD.

    The scale is sum_i w_i ||B_i|| ||A_i|| (>= ||X||): the size of the inputs, which bounds the
    backward error of any stable method even when clients cancel each other.
    """
    X = dense_aggregate(Bs, As, weights)
    n = len(Bs)
    w = [1.0 / n] * n if weights is None else [x / sum(weights) for x in weights]
    scale = sum(wi * float(B.double().norm() * A.double().norm()) for wi, B, A in zip(w, Bs, As))
    got = float(torch.linalg.matrix_norm(X - B_g.double() @ A_g.double()))
    return (got - optimal_error(X, rank)) / max(scale, 1e-300)


@SETTINGS
@given(problems())
def test_reduced_reaches_the_dense_optimum_float64(problem):
    # Prepare
    d, k, ranks, weights, rank, kind, seed = problem
    Bs, As = client_factors(seed, d, k, ranks, kind)
    # Execute
    B_g, A_g = reconstruct(Bs, As, rank, weights=weights, mode="reduced")
    # Assert
    assert abs(excess_error(Bs, As, weights, B_g, A_g, rank)) <= 1e-10


@SETTINGS
@given(problems())
def test_reduced_reaches_the_dense_optimum_float32(problem):
    d, k, ranks, weights, rank, kind, seed = problem
    Bs, As = client_factors(seed, d, k, ranks, kind, dtype=torch.float32)
    B_g, A_g = reconstruct(Bs, As, rank, weights=weights, mode="reduced")
    assert B_g.dtype == A_g.dtype == torch.float32
    assert abs(excess_error(Bs, As, weights, B_g, A_g, rank)) <= 1e-5


@SETTINGS
@given(problems())
def test_randomized_with_full_sketch_equals_the_optimum(problem):
    d, k, ranks, weights, rank, kind, seed = problem
    Bs, As = client_factors(seed, d, k, ranks, kind)
    # oversample large enough that l = min(rank + p, r_tot) = r_tot
    g = torch.Generator().manual_seed(seed)
    B_g, A_g = reconstruct(Bs, As, rank, weights=weights, mode="randomized", oversample=sum(ranks), generator=g)
    assert abs(excess_error(Bs, As, weights, B_g, A_g, rank)) <= 1e-5


@SETTINGS
@given(problems())
def test_dense_mode_reaches_the_optimum(problem):
    d, k, ranks, weights, rank, kind, seed = problem
    Bs, As = client_factors(seed, d, k, ranks, kind)
    B_g, A_g = reconstruct(Bs, As, rank, weights=weights, mode="dense")
    assert abs(excess_error(Bs, As, weights, B_g, A_g, rank)) <= 1e-10


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("d,k", [(60, 60), (80, 40)])
def test_randomized_meets_the_halko_bound_on_average(p, d, k):
    """Appendix G.1.2: E||B_g A_g - X||_2 <= [2 + 4 sqrt((R_g+p)/(p-1)) sqrt(min(d, k))] sigma_{R_g+1}(X)."""
    # Prepare: a slowly decaying spectrum makes sigma_{R_g+1} matter
    n, r, rank = 6, 6, 4
    Bs, As = client_factors(7, d, k, [r] * n)
    Bs = [B * 0.8**i for i, B in enumerate(Bs)]
    X = dense_aggregate(Bs, As)
    sigma = torch.linalg.svdvals(X)
    bound = (2 + 4 * math.sqrt((rank + p) / (p - 1)) * math.sqrt(min(d, k))) * float(sigma[rank])
    # Execute
    errors = []
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        B_g, A_g = reconstruct(Bs, As, rank, mode="randomized", oversample=p, generator=g)
        errors.append(float(torch.linalg.matrix_norm(B_g @ A_g - X, ord=2)))
    # Assert: the mean respects the bound, and no draw beats Eckart-Young
    assert sum(errors) / len(errors) <= bound
    assert min(errors) >= float(sigma[rank]) * (1 - 1e-9)


def test_randomized_is_reproducible_with_a_seeded_generator():
    Bs, As = client_factors(3, 40, 30, [4, 4, 4])
    runs = [
        reconstruct(Bs, As, 2, mode="randomized", oversample=2, generator=torch.Generator().manual_seed(5))
        for _ in range(2)
    ]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@SETTINGS
@given(problems())
def test_shapes_and_zero_padding(problem):
    d, k, ranks, weights, rank, kind, seed = problem
    Bs, As = client_factors(seed, d, k, ranks, kind)
    B_g, A_g, S = reconstruct(Bs, As, rank, weights=weights, return_spectrum=True)
    q = min(d, k, sum(ranks))
    assert B_g.shape == (d, rank) and A_g.shape == (rank, k)
    assert S.shape == (q,)
    if rank > q:  # the aggregate has at most q singular values: the rest is padding
        assert torch.count_nonzero(B_g[:, q:]) == 0
        assert torch.count_nonzero(A_g[q:, :]) == 0


@SETTINGS
@given(problems())
def test_spectrum_equals_the_dense_singular_values(problem):
    d, k, ranks, weights, rank, kind, seed = problem
    Bs, As = client_factors(seed, d, k, ranks, kind)
    _, _, S = reconstruct(Bs, As, rank, weights=weights, return_spectrum=True)
    dense = torch.linalg.svdvals(dense_aggregate(Bs, As, weights))[: S.shape[0]]
    torch.testing.assert_close(S, dense, atol=1e-10 * (1 + float(dense[0])), rtol=0)


def test_A_g_has_orthonormal_rows_and_B_g_carries_the_singular_values():
    Bs, As = client_factors(11, 50, 40, [3, 5, 2])
    B_g, A_g, S = reconstruct(Bs, As, 4, return_spectrum=True)
    torch.testing.assert_close(A_g @ A_g.T, torch.eye(4, dtype=torch.float64))
    torch.testing.assert_close(torch.linalg.vector_norm(B_g, dim=0), S[:4])


@pytest.mark.parametrize("dtype,rtol", [(torch.float16, 2e-2), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("mode", ["reduced", "randomized", "dense"])
def test_low_precision_round_trip(dtype, rtol, mode):
    # Prepare
    Bs, As = client_factors(5, 48, 32, [4, 2, 4], dtype=dtype)
    # Execute
    B_g, A_g = reconstruct(Bs, As, 4, mode=mode, generator=torch.Generator().manual_seed(0))
    # Assert: same dtype out, product as good as the float32 optimum up to the dtype's precision
    assert B_g.dtype == A_g.dtype == dtype
    X = dense_aggregate(Bs, As)
    err = float(torch.linalg.matrix_norm(X - B_g.double() @ A_g.double()))
    assert err <= optimal_error(X, 4) + rtol * float(torch.linalg.matrix_norm(X))


def test_weights_are_normalised_and_default_to_uniform():
    Bs, As = client_factors(2, 30, 20, [2, 3, 4])
    uniform = reconstruct(Bs, As, 3)
    explicit = reconstruct(Bs, As, 3, weights=[5.0, 5.0, 5.0])
    torch.testing.assert_close(uniform[0] @ uniform[1], explicit[0] @ explicit[1])
    weighted = reconstruct(Bs, As, 3, weights=torch.tensor([1.0, 2.0, 0.0]))
    alone = reconstruct(Bs[:2], As[:2], 3, weights=[1.0, 2.0])
    torch.testing.assert_close(weighted[0] @ weighted[1], alone[0] @ alone[1])


@pytest.mark.parametrize("mode", ["reduced", "dense"])
def test_batched_layers_equal_one_call_per_layer(mode):
    # Prepare: 5 layers of the same shapes, heterogeneous client ranks
    layers = [client_factors(s, 24, 16, [2, 3, 1]) for s in range(5)]
    Bs = [torch.stack([layer[0][i] for layer in layers]) for i in range(3)]
    As = [torch.stack([layer[1][i] for layer in layers]) for i in range(3)]
    # Execute
    B_g, A_g = reconstruct(Bs, As, 3, mode=mode)
    # Assert
    for j, (Bl, Al) in enumerate(layers):
        b, a = reconstruct(Bl, Al, 3, mode=mode)
        torch.testing.assert_close(B_g[j] @ A_g[j], b @ a)


def test_adapter_reconstruction_groups_modules_and_keeps_order():
    # Prepare: two shape groups (q: 32x16, v: 32x24) and a client whose rank differs per module
    names = ["l0.q", "l0.v", "l1.q", "l1.v"]
    shapes = {"q": (32, 16), "v": (32, 24)}
    uploads = []
    for c, r in enumerate([2, 4, 3]):
        upload = {}
        for m, name in enumerate(names):
            d, k = shapes[name[-1]]
            rr = r + (name == "l1.v")
            Bs, As = client_factors(100 * c + m, d, k, [rr])
            upload[name] = (Bs[0], As[0])
        uploads.append(upload)
    weights = [1.0, 2.0, 3.0]
    # Execute
    out, spectra = reconstruct_adapter(uploads, 4, weights=weights, return_spectrum=True)
    # Assert
    assert list(out) == names
    for name in names:
        Bs = [u[name][0] for u in uploads]
        As = [u[name][1] for u in uploads]
        B_g, A_g = out[name]
        assert B_g.shape == (shapes[name[-1]][0], 4)
        assert abs(excess_error(Bs, As, weights, B_g, A_g, 4)) <= 1e-10
        torch.testing.assert_close(
            spectra[name], torch.linalg.svdvals(dense_aggregate(Bs, As, weights))[: spectra[name].numel()]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_adapter_stacks_every_module_at_once_and_matches_each_module_alone(dtype):
    # Prepare: float32/bf16 uploads take the Gram route from one stack of all modules; group q has equal ranks
    # (one torch.stack, then a transposing copy), group v has a client whose rank differs (the concatenating branch)
    names = ["l0.q", "l0.v", "l1.q", "l1.v"]
    shapes = {"q": (40, 24), "v": (40, 32)}
    uploads = [{} for _ in range(3)]
    for m, name in enumerate(names):
        d, k = shapes[name[-1]]
        ranks = [3, 3, 3] if name.endswith("q") else [2, 5, 3]
        Bs, As = client_factors(m, d, k, ranks)
        for c in range(3):
            uploads[c][name] = (Bs[c].to(dtype), As[c].to(dtype))
    weights = [1.0, 2.0, 3.0]
    # Execute
    out = reconstruct_adapter(uploads, 4, weights=weights)
    # Assert: the same factors as the module reconstructed alone (its own stacking), at the float64 optimum's
    # accuracy up to the uploads' rounding
    for name in names:
        Bs, As = [u[name][0] for u in uploads], [u[name][1] for u in uploads]
        B_g, A_g = out[name]
        b, a = reconstruct(Bs, As, 4, weights=weights)
        assert B_g.dtype == dtype and B_g.shape == (shapes[name[-1]][0], 4)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(B_g.double() @ A_g.double(), b.double() @ a.double(), rtol=tol, atol=0)
        exact = ([B.double() for B in Bs], [A.double() for A in As])
        excess = tail_excess(*exact, B_g.double(), A_g.double(), 4, weights)
        assert excess <= 2 * max(float32_floor(*exact, 4, weights), 1e-7) if dtype == torch.float32 else 3e-2, name


@pytest.mark.parametrize("ranks", [[2, 2], [2, 3]], ids=["equal ranks", "mixed ranks"])
def test_float32_adapter_names_the_module_with_bad_factors(ranks):
    Bs, As = client_factors(0, 8, 6, ranks, dtype=torch.float32)
    bad = As[0].clone()
    bad[1, 2] = float("inf")
    uploads = [{"q": (Bs[0], As[0]), "v": (Bs[0], bad)}, {"q": (Bs[1], As[1]), "v": (Bs[1], As[1])}]
    with pytest.raises(ValueError, match=r"module 'v': A of client 0 contains NaN or Inf"):
        reconstruct_adapter(uploads, 2)


# ---------------------------------------------------------------------------------------------- bad input

B2, A2 = client_factors(0, 8, 6, [2, 3])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(Bs=[], As=[]), r"Bs is empty"),
        (dict(Bs=B2, As=A2[:1]), r"len\(Bs\)\(=2\) != len\(As\)\(=1\)"),
        (dict(Bs=[B2[0], B2[1]], As=[A2[1], A2[0]]), r"client 0: B has r=2 columns but A has 3 rows"),
        (dict(Bs=[B2[0], torch.randn(9, 3, dtype=torch.float64)], As=A2), r"client 1: B has shape \(9, 3\)"),
        (dict(Bs=B2, As=[A2[0], torch.randn(3, 7, dtype=torch.float64)]), r"client 1: A has shape \(3, 7\)"),
        (dict(Bs=[B2[0], B2[1].float()], As=[A2[0], A2[1].float()]), r"client 1: dtypes"),
        (dict(Bs=[torch.zeros(8, 0)], As=[torch.zeros(0, 6)]), r"rank r_i must be >= 1"),
        (dict(rank=0), r"rank\(=0\) must be a positive int"),
        (dict(rank=-2), r"rank\(=-2\) must be a positive int"),
        (dict(rank=2.5), r"rank\(=2.5\) must be a positive int"),
        (dict(weights=[1.0, -1.0]), r"weights\[1\]\(=-1.0\) is negative"),
        (dict(weights=[0.0, 0.0]), r"weights are all zero"),
        (dict(weights=[1.0]), r"len\(weights\)\(=1\) != number of clients\(=2\)"),
        (dict(weights=[1.0, float("nan")]), r"weights\[1\]\(=nan\) is not finite"),
        (dict(mode="qr"), r"mode\(='qr'\) must be one of"),
        (dict(mode="randomized", oversample=-1), r"oversample\(=-1\) must be an int >= 0"),
        (dict(Bs=[B2[0], B2[1].clone().fill_(float("nan"))]), r"B of client 1 contains NaN or Inf"),
        (dict(As=[A2[0].clone().fill_(float("inf")), A2[1]]), r"A of client 0 contains NaN or Inf"),
        (dict(Bs=[B2[0].int(), B2[1]]), r"client 0: factors must be real floating point"),
    ],
)
def test_bad_input_raises_value_error_naming_the_problem(kwargs, match):
    args = dict(Bs=B2, As=A2, rank=2) | kwargs
    with pytest.raises(ValueError, match=match):
        reconstruct(args.pop("Bs"), args.pop("As"), **args)


@pytest.mark.parametrize("mode", ["reduced", "randomized", "dense"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_factors_are_named_in_every_mode(mode, bad):
    Bs, As = client_factors(1, 16, 12, [3, 2, 4])
    As[2] = As[2].clone()
    As[2][1, 5] = bad
    with pytest.raises(ValueError, match=r"A of client 2 contains NaN or Inf"):
        reconstruct(Bs, As, 2, mode=mode, generator=torch.Generator().manual_seed(0))


def test_adapter_rejects_clients_with_different_modules():
    Bs, As = client_factors(0, 8, 6, [2, 2])
    with pytest.raises(ValueError, match=r"client 1 uploads different modules than client 0: missing \['v'\]"):
        reconstruct_adapter([{"q": (Bs[0], As[0]), "v": (Bs[0], As[0])}, {"q": (Bs[1], As[1])}], 2)


def test_adapter_names_the_module_with_bad_factors():
    Bs, As = client_factors(0, 8, 6, [2, 2])
    bad = Bs[1].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"module 'v': B of client 1 contains NaN or Inf"):
        reconstruct_adapter([{"q": (Bs[0], As[0]), "v": (Bs[0], As[0])}, {"q": (Bs[1], As[1]), "v": (bad, As[1])}], 2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("d", "k"), [(24, 80), (80, 24), (20, 20)])
def test_float32_stacks_wider_than_the_layer_take_the_float64_qr_core_and_reach_the_optimum(monkeypatch, kind, d, k):
    # (24, 80): QR of A only, core 24 x 40 (the Gram of H H^T); (80, 24): QR of B only (H^T H); (20, 20): no QR,
    # the core is the aggregate
    from fs_fedpa.core import factored_svd as module

    gram = module.gram_route
    calls = []
    monkeypatch.setattr(module, "gram_route", lambda *args: calls.append(args[0].shape) or gram(*args))
    Bs, As = client_factors(3, d, k, [8] * 5, kind, dtype=torch.float32)  # sum r_i = 40 > min(d, k)
    weights = [1.0, 2.0, 0.5, 1.0, 3.0]
    B_g, A_g = reconstruct(Bs, As, 8, weights=weights, mode="reduced")
    adapter = reconstruct_adapter([{"m": (B, A)} for B, A in zip(Bs, As)], 8, weights=weights)["m"]
    assert calls == []  # the 40 x 40 Gram eigenproblems would outgrow the min(d, 40) x min(k, 40) QR core
    assert abs(excess_error(Bs, As, weights, B_g, A_g, 8)) <= 1e-5
    assert abs(excess_error(Bs, As, weights, *adapter, 8)) <= 1e-5
    Bs, As = client_factors(3, 48, 48, [8] * 5, kind, dtype=torch.float32)  # 40 <= min(d, k): the Gram route
    B_g, A_g = reconstruct(Bs, As, 8, weights=weights, mode="reduced")
    assert len(calls) == 1 and abs(excess_error(Bs, As, weights, B_g, A_g, 8)) <= 1e-5


def test_an_option_either_function_does_not_know_is_refused_not_ignored():
    """Both functions take their SVD options as keywords (:class:`SVDOptions`); a misspelt one must not fall back to
    the default mode silently."""
    from fs_fedpa.core.reconstruct import reconstruct, reconstruct_adapter

    B, A = torch.randn(5, 2, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="unknown option"):
        reconstruct([B], [A], 2, mod="dense")
    with pytest.raises(TypeError, match="unknown option"):
        reconstruct_adapter([{"q": (B, A)}], 2, oversampling=4)
    dense = reconstruct([B], [A], 2, mode="dense")
    torch.testing.assert_close(dense[0] @ dense[1], B @ A)


def test_small_solves_go_to_the_host_only_where_the_device_would_loop_over_them():
    """torch's CUDA eigh batches up to 32 x 32 and loops over larger ones (RoBERTa-large's sum r_i = 40, Llama's 48):
    those stacks are solved on the host; a CPU stack, a single matrix or a small one stays where it is."""
    from fs_fedpa.core.factored_svd import on_host

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert on_host(torch.Size([48, 40, 40]), cuda) and on_host(torch.Size([2, 3, 48, 48]), cuda)
    assert not on_host(torch.Size([48, 32, 32]), cuda)  # cuSOLVER's batched Jacobi solver
    assert not on_host(torch.Size([1, 40, 40]), cuda) and not on_host(torch.Size([40, 40]), cuda)
    assert not on_host(torch.Size([48, 40, 40]), cpu)


def test_small_eigh_is_torch_s_where_it_stays():
    from fs_fedpa.core.factored_svd import small_eigh

    X = torch.randn(6, 40, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    M = X @ X.mT
    lam, E = small_eigh(M)
    want_lam, want_E = torch.linalg.eigh(M)
    assert torch.equal(lam, want_lam) and torch.equal(E, want_E)


def test_the_host_route_of_the_small_solves_gives_todays_reconstruction(monkeypatch):
    """reconstruct_adapter with every small eigenproblem sent through small_eigh's host route (forced here, where the
    device is the host) equals today's reconstruction bit for bit: 12 modules of two shapes, N = 10 clients of
    r = 4 (sum r_i = 40 > 32, the route a CUDA batch takes), float32 uploads (the Gram route)."""
    from fs_fedpa.core import factored_svd

    g = torch.Generator().manual_seed(3)
    shapes = {f"q{i}": (96, 80) for i in range(6)} | {f"v{i}": (48, 80) for i in range(6)}
    uploads = [{n: (torch.randn(d, 4, generator=g), torch.randn(4, k, generator=g)) for n, (d, k) in shapes.items()}
               for _ in range(10)]  # fmt: skip
    today, spectra = reconstruct_adapter(uploads, 4, return_spectrum=True)
    calls = []
    real = factored_svd.on_host
    monkeypatch.setattr(factored_svd, "on_host", lambda shape, device: calls.append(shape) or True)
    hosted, hosted_spectra = reconstruct_adapter(uploads, 4, return_spectrum=True)
    assert calls and all(s[-1] == 40 for s in calls)  # the K eigenproblems of both groups took the route
    assert not real(calls[0], torch.device("cpu"))
    for n in shapes:
        assert torch.equal(hosted[n][0], today[n][0]) and torch.equal(hosted[n][1], today[n][1])
        assert torch.equal(hosted_spectra[n], spectra[n])
