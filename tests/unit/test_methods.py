"""Every federated method against the shared contract, and each method's defining server rule."""

from __future__ import annotations

import pytest
import torch

from fs_fedpa import lora
from fs_fedpa.config import FedPAConfig
from fs_fedpa.core.ranks import RankPlan
from fs_fedpa.methods import METHODS, get_method
from fs_fedpa.plugin.config_fs import PLUGIN_METHODS
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
    contract_ranks(name)


def contract_ranks(name):
    """The ranks of a method's initial state, downlink and aggregate, read from its declarations (never its name)."""
    # Prepare
    get_method("fedpa")  # registers every method
    full = bool(METHODS[name].full_references)
    method = _method(name, [4, 4, 4], reference_ranks=None if full else [2, 3, 4])
    method.bind(SHAPES)
    gen = torch.Generator().manual_seed(0)
    init = method.init_global(SHAPES, gen)
    # Execute
    client = method.client_init(init, 1)
    uploads = _uploads([4, 4, 4])
    if not any(method.trainable(rnd)[1] for rnd in range(2)):  # its clients never change their shared, frozen A
        uploads = [{n: (B, uploads[0][n][1]) for n, (B, _) in u.items()} for u in uploads]
    if not method.state_is_factors:  # its own state: what its clients would send, completed
        uploads = [_state_uploads(method, init, c) for c in range(3)]
    global_, _ = method.aggregate(uploads, [1.0, 2.0, 3.0], [0, 1, 2], gen)
    down = method.downlink(global_, 0)
    # Assert (on the factors of the update: the state itself for every method but Ravan)
    client, global_, down = method.expand(client), method.expand(global_), method.expand(down)
    r = {n: 4 if method.state_is_factors else method.H * method.ranks[n] for n in SHAPES}
    assert all(B.shape[1] == r[n] and A.shape[0] == r[n] for n, (B, A) in client.items())
    assert all(B.shape == (SHAPES[n][0], r[n]) and A.shape == (r[n], SHAPES[n][1]) for n, (B, A) in global_.items())
    assert all(B.shape[1] == (r[n] if full else 2) for n, (B, _) in down.items())  # R_1 = 2


@pytest.mark.parametrize("name", PLUGIN_METHODS)
def test_contract_payload_completion_and_model_round_trip(name):
    contract_payload(name)


def contract_payload(name):
    """A method's state through a PEFT model and back, and its upload completed by the server."""
    # Prepare: a PEFT model whose LoRA modules have SHAPES' (d, k)
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_TwoLinear(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"]))
    shapes = {n: (layer.out_features, layer.in_features) for n, layer in lora.lora_layers(model).items()}
    full = bool(METHODS[name].full_references)
    method = _method(name, [4, 4, 4], reference_ranks=None if full else [4, 4, 4])
    method.bind(shapes)
    global_ = method.init_global(shapes, torch.Generator().manual_seed(0))
    state = method.client_init(global_, 1)
    # Execute: into the model and back; what a client sends, completed by the server
    method.load(model, state, method.trainable(1), 1, 1)
    read = method.read(model)
    sent = method.before_upload(read, global_, 1)
    payload = method.upload_payload(sent, 1, 1)
    completed = method.complete_upload(payload, global_, 1, 1)
    # Assert: the model holds the state bit for bit; only the round's parts travel; the server's completion is what
    # was sent (the parts that did not travel are the global ones), as factors of the module's shape
    assert all(torch.equal(read[n][j], state[n][j]) for n in state for j in (0, 1))
    assert all(set(parts) == set(method.upload_parts(1)) for parts in payload.values())
    expanded = method.expand(completed)
    for n, (B, A) in expanded.items():
        assert B.shape[0] == shapes[n][0] and A.shape[1] == shapes[n][1] and B.shape[1] == A.shape[0]
        torch.testing.assert_close(B @ A, (lambda f: f[0] @ f[1])(method.expand(sent)[n]))


def test_a_new_method_is_one_class_and_passes_the_contract():
    """A toy method defined here alone, one method (the mean of the products, truncated to rank R_g by their dense
    SVD; everything else the defaults) with one option of its own, registered by subclassing, runs through both
    contract checks, and its option is a key of the fedpa section (``fedpa.toy_product_mean.scale``, its help, the
    old flat name it declares); the registry is left as it was."""
    from dataclasses import dataclass

    from fs_fedpa.config_sections import key
    from fs_fedpa.methods.base import FederatedMethod
    from fs_fedpa.plugin import config_fs

    get_method("fedpa")
    before = dict(METHODS)

    @dataclass
    class ToyOptions:
        scale: float = key(1.0, "the toy's scale", was="toy_scale")

    class ToyProductMean(FederatedMethod):
        name = "toy_product_mean"
        options = ToyOptions

        def aggregate(self, uploads, weights, clients, generator, rnd=0):
            total = sum(weights)
            out, spectra = {}, {}
            for n in uploads[0]:
                product = sum(w / total * (u[n][0] @ u[n][1]) for u, w in zip(uploads, weights))
                U, S, Vh = torch.linalg.svd(product, full_matrices=False)
                R = self.plan.R_g
                out[n], spectra[n] = (U[:, :R] * S[:R], Vh[:R]), S
            return out, spectra

    try:
        assert METHODS["toy_product_mean"] is ToyProductMean
        contract_ranks("toy_product_mean")
        contract_payload("toy_product_mean")
        assert config_fs.default_node()["toy_product_mean"] == {"scale": 1.0}
        assert ("toy_product_mean.scale", "1.0", "the toy's scale") in config_fs.describe_all()
        assert config_fs.flat_keys()["toy_scale"] == "toy_product_mean.scale"
        toy = FedPAConfig(methods={"toy_product_mean": ToyOptions(scale=2.0)})
        options = ToyProductMean(toy, RankPlan.build(1, 2))
        assert options.opts.scale == 2.0 and ToyProductMean(FedPAConfig(), RankPlan.build(1, 2)).opts.scale == 1.0
    finally:
        METHODS.pop("toy_product_mean", None)
    assert METHODS == before


@pytest.mark.parametrize("name", PLUGIN_METHODS)
def test_each_method_declares_exactly_the_optional_hooks_it_implements(name):
    """``uses`` names the optional hooks a method's class (or a parent of it) defines, read here from the classes'
    own dictionaries along the MRO, not from the check the class statement runs; the workers skip every other one."""
    from fs_fedpa.methods.base import OPTIONAL_HOOKS, FederatedMethod

    cls = get_method(name)
    defined = {h for h in OPTIONAL_HOOKS for k in cls.__mro__ if k is not FederatedMethod and h in vars(k)}
    assert set(cls.uses) == defined


def test_an_undeclared_or_unimplemented_hook_is_refused_when_the_class_is_defined():
    from fs_fedpa.methods.base import FederatedMethod

    before = dict(METHODS)
    with pytest.raises(TypeError, match=r"implements \['end_round'\] and declares \[\]"):

        class Undeclared(FederatedMethod):
            def end_round(self, local, client, rnd):
                return {}

    with pytest.raises(TypeError, match=r"implements \[\] and declares \['fold'\]"):

        class Unimplemented(FederatedMethod):
            uses = frozenset({"fold"})

    with pytest.raises(TypeError, match="are not hooks"):

        class NotAHook(FederatedMethod):
            uses = frozenset({"aggregate"})

    assert METHODS == before


class _TwoLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v = torch.nn.Linear(10, 12), torch.nn.Linear(8, 12)


def _state_uploads(method, global_, client, seed=0, rnd=0):
    """What a Ravan client sends after training (random cores and scales), completed by the server."""
    g = torch.Generator().manual_seed(seed * 100 + client)
    trained = {n: (torch.randn(H.shape, generator=g, dtype=torch.float64), torch.rand(s.shape, generator=g,
                   dtype=torch.float64) + 0.5) for n, (H, s) in global_.items()}  # fmt: skip
    sent = method.before_upload(trained, global_, rnd)
    return method.complete_upload(method.upload_payload(sent, client, rnd), global_, client, rnd)


def test_fedit_averages_each_factor():
    uploads, w = _uploads([3, 3]), [1.0, 3.0]
    global_, _ = _method("fedit", [3, 3]).aggregate(uploads, w, [0, 1], torch.Generator())
    for n, (B, A) in global_.items():
        torch.testing.assert_close(B, 0.25 * uploads[0][n][0] + 0.75 * uploads[1][n][0])
        torch.testing.assert_close(A, 0.25 * uploads[0][n][1] + 0.75 * uploads[1][n][1])


@pytest.mark.parametrize(
    ("name", "rnd", "sent"), [("ffa_lora", 0, "B"), ("ffa_lora", 1, "B"), ("rolora", 0, "B"), ("rolora", 1, "A")]
)
def test_one_factor_methods_send_one_factor_and_keep_the_other_global_one_bit_for_bit(name, rnd, sent):
    # Prepare: the global factors the clients received, and what they trained
    method = _method(name, [3, 3])
    global_ = _uploads([3], seed=7)[0]
    trained = _uploads([3, 3])
    keep = {"B": 1, "A": 0}[sent]  # index of the factor that was not trained
    # Execute: each client sends only `sent`; the server completes the upload and averages
    assert method.upload_parts(rnd) == (sent,)
    uploads = [
        method.complete_upload({n: {sent: pair[1 - keep]} for n, pair in t.items()}, global_, c)
        for c, t in enumerate(trained)
    ]
    new, _ = method.aggregate(uploads, [1.0, 3.0], [0, 1], torch.Generator())
    # Assert: the untrained factor is the global one bit for bit, the trained one the weighted mean
    for n, pair in new.items():
        assert torch.equal(pair[keep], global_[n][keep])
        torch.testing.assert_close(pair[1 - keep], 0.25 * trained[0][n][1 - keep] + 0.75 * trained[1][n][1 - keep])


def test_fedit_refuses_heterogeneous_ranks():
    with pytest.raises(ValueError, match=r"fedit averages factors, so every client needs the same rank"):
        _method("fedit", [2, 4])


@pytest.mark.parametrize("name", ["flexlora", "fedpa"])
def test_product_space_methods_reach_the_svd_optimum_with_heterogeneous_ranks(name):
    uploads, w = _uploads([2, 3, 5]), [1.0, 1.0, 2.0]
    method = _method(name, [2, 3, 5])
    global_, _ = method.aggregate(uploads, w, [0, 1, 2], torch.Generator())
    for n, (B, A) in global_.items():
        X = dense_aggregate([u[n][0] for u in uploads], [u[n][1] for u in uploads], w)
        assert float(torch.linalg.matrix_norm(X - B @ A)) == pytest.approx(optimal_error(X, 5), abs=1e-9)


def test_what_each_method_starts_from_trains_and_aligns():
    own = {n: (B.requires_grad_(), A.requires_grad_()) for n, (B, A) in _uploads([2])[0].items()}
    received = _uploads([2], seed=1)[0]
    keeps = {"fedpa": (True, True), "local_only": (True, True), "fedsa_lora": (True, False)}
    trains = {"ffa_lora": [(True, False)] * 2, "fedsvd": [(True, False)] * 2, "rolora": [(True, False), (False, True)]}
    for name in PLUGIN_METHODS:
        method = _method(name, [2])
        start = method.start_round(received, own, 0, 0)
        # a fresh LoRA; received cores, scales 1; a mix of both (own tests)
        for n in own if name not in ("flora", "ravan", "fedpa_partial_restart") else ():
            for j, kept in enumerate(keeps.get(name, (False, False))):
                assert torch.equal(start[n][j], (own if kept else received)[n][j]), (name, n, j)
        assert [method.trainable(0), method.trainable(1)] == trains.get(name, [(True, True)] * 2), name
        # hetlora: its self-pruning term
        aligns = name in ("fedpa", "fedpa_no_preservation", "fedpa_partial_restart", "hetlora")
        assert (method.alignment(own, received, 1.0) is not None) is aligns, name


def test_fedpa_starts_every_round_from_its_own_factors_objects():
    own, received = _uploads([2])[0], _uploads([2], seed=1)[0]
    start = _method("fedpa", [2]).start_round(received, own, 0, 3)
    assert all(start[n][0] is B and start[n][1] is A for n, (B, A) in own.items())


def test_fedsa_lora_evaluates_its_own_B_with_the_global_A():
    own, received = _uploads([2])[0], _uploads([2], seed=1)[0]
    evaluated = _method("fedsa_lora", [2]).evaluation_factors(received, own, 0)
    assert all(torch.equal(evaluated[n][0], own[n][0]) and torch.equal(evaluated[n][1], received[n][1]) for n in own)
    alone = _method("local_only", [2]).evaluation_factors(received, own, 0)
    assert all(alone[n][0] is own[n][0] and alone[n][1] is own[n][1] for n in own)
    default = _method("fedit", [2]).evaluation_factors(received, own, 0)
    assert all(default[n][0] is received[n][0] for n in own)


def _proper_procrustes(M):
    """Independent reference, written from the paper: R = U diag(1, .., det(U V^T)) V^T for M = U S V^T (numpy)."""
    import numpy as np

    U, _, Vt = np.linalg.svd(M.numpy())
    D = np.eye(U.shape[0])
    D[-1, -1] = np.sign(np.linalg.det(U @ Vt))
    return torch.from_numpy(U @ D @ Vt)


def test_fedrot_aligns_nothing_in_round_0_then_A_in_odd_and_B_in_even_rounds():
    method = _method("fedrot_lora", [3, 3])
    local, received = _uploads([3])[0], _uploads([3], seed=5)[0]
    assert all(method.before_upload(local, received, 0)[n][0] is B for n, (B, _) in local.items())
    for rnd, aligned in ((1, "A"), (2, "B"), (3, "A")):
        rotated = method.before_upload(local, received, rnd)
        for n, (B, A) in local.items():
            B_ref, A_ref = received[n]
            # the authors' rule: A aligned by min ||R^T A - A_ref|| (M = A A_ref^T), B by min ||B R - B_ref||
            R = _proper_procrustes(A @ A_ref.T if aligned == "A" else B.T @ B_ref)
            torch.testing.assert_close(rotated[n][0], B @ R)
            torch.testing.assert_close(rotated[n][1], R.T @ A)


def test_fedrot_soft_strength_interpolates_between_fedit_and_the_full_rotation():
    local, received = _uploads([3])[0], _uploads([3], seed=5)[0]
    fedrot = get_method("fedrot_lora")
    off = fedrot(FedPAConfig(methods={"fedrot_lora": fedrot.options(strength=0.0)}), RankPlan.build(2, 3))
    off = off.before_upload(local, received, 1)
    assert all(torch.allclose(off[n][1], A) for n, (_, A) in local.items())
    half = fedrot(FedPAConfig(methods={"fedrot_lora": fedrot.options(strength=0.6)}), RankPlan.build(2, 3))
    for n, (B, A) in half.before_upload(local, received, 1).items():
        R_full = _proper_procrustes(local[n][1] @ received[n][1].T)
        R_soft = _proper_procrustes(0.4 * torch.eye(3, dtype=torch.float64) + 0.6 * R_full)  # nearest rotation
        torch.testing.assert_close(A, R_soft.T @ local[n][1])
        torch.testing.assert_close(B @ A, local[n][0] @ local[n][1])


def test_hetlora_weights_padded_factors_by_the_norm_of_each_update():
    # Prepare
    uploads = _uploads([2, 4])
    method = _method("hetlora", [2, 4])
    # Execute
    global_, _ = method.aggregate(uploads, [5.0, 1.0], [0, 1], torch.Generator())
    # Assert: p_k = ||B_k A_k||_F / sum_j ||B_j A_j||_F (dense products), data sizes ignored
    for n, (B, A) in global_.items():
        norms = [float(torch.linalg.matrix_norm(u[n][0] @ u[n][1])) for u in uploads]
        p = [x / sum(norms) for x in norms]
        pad_B = torch.cat([uploads[0][n][0], torch.zeros(SHAPES[n][0], 2, dtype=torch.float64)], dim=1)
        pad_A = torch.cat([uploads[0][n][1], torch.zeros(2, SHAPES[n][1], dtype=torch.float64)], dim=0)
        torch.testing.assert_close(B, p[0] * pad_B + p[1] * uploads[1][n][0])
        torch.testing.assert_close(A, p[0] * pad_A + p[1] * uploads[1][n][1])
    assert method.downlink(global_, 0)["q"][0].shape[1] == 2


def test_hetlora_prunes_a_module_whose_tail_shrank_and_keeps_the_others():
    # Prepare: gamma 0.7 on rank 4: the tail is index >= floor(2.8) = 2, a pruned module keeps rank 2
    hetlora = get_method("hetlora")
    method = hetlora(FedPAConfig(methods={"hetlora": hetlora.options(gamma=0.7, lam=0.1)}), RankPlan.build(1, 4))
    received = _uploads([4], seed=3)[0]
    start = method.start_round(received, {n: (B[:, :4], A[:4]) for n, (B, A) in received.items()}, 0, 1)
    trained = {n: (B.clone(), A.clone()) for n, (B, A) in start.items()}
    trained["q"][0][:, 2:] *= 0.5  # q's tail shrank during the round, v's grew
    trained["v"][0][:, 2:] *= 2.0
    # Execute
    kept = method.end_round(trained, 0, 1)
    # Assert
    assert kept["q"][0].shape[1] == 2 and torch.equal(kept["q"][0], trained["q"][0][:, :2])
    assert kept["v"][0].shape[1] == 4
    term = method.alignment(trained, {}, 1.0)
    expected = sum(0.1 * torch.linalg.norm(B[:, 2:]) * torch.linalg.norm(A[2:]) for B, A in trained.values())
    torch.testing.assert_close(term, expected)
    # the next round starts from the global factors at the pruned rank
    assert method.start_round(received, kept, 0, 2)["q"][0].shape[1] == 2


def test_hetlora_pad_pads_averages_and_truncates_back():
    uploads, w = _uploads([2, 4]), [1.0, 1.0]
    method = _method("hetlora_pad", [2, 4])
    global_, _ = method.aggregate(uploads, w, [0, 1], torch.Generator())
    for n, (B, A) in global_.items():
        assert B.shape[1] == 4 and A.shape[0] == 4
        torch.testing.assert_close(B[:, :2], 0.5 * (uploads[0][n][0] + uploads[1][n][0][:, :2]))
        torch.testing.assert_close(B[:, 2:], 0.5 * uploads[1][n][0][:, 2:])  # the rank-2 client padded zeros
        torch.testing.assert_close(A[2:], 0.5 * uploads[1][n][1][2:])
    start = method.start_round(global_, _uploads([2])[0], 0, 1)
    assert all(B.shape[1] == 2 and A.shape[0] == 2 for B, A in start.values())


def test_flexlora_weighs_by_local_data_size_and_others_by_fs_sample_counts():
    assert _method("flexlora", [2, 2]).weights([20, 20], [100, 300]) == [100.0, 300.0]
    assert _method("flexlora", [2, 2]).weights([20, 20], [100, None]) == [20, 20]
    assert _method("fedpa", [2, 2]).weights([20, 30], [100, 300]) == [20, 30]


@pytest.mark.parametrize("name, ranks", [("fedex_lora", [3, 3, 3]), ("flora", [2, 3, 5])])
def test_exact_methods_global_adapter_plus_merge_is_the_weighted_average_of_the_products(name, ranks):
    method = _method(name, ranks)
    uploads, w = _uploads(ranks), [1.0, 2.0, 3.0]
    global_, _ = method.aggregate(uploads, w, [0, 1, 2], torch.Generator())
    merge = method.merge(uploads, w, global_)
    assert method.merges and not _method("fedit", [3, 3]).merges
    for n, (B, A) in global_.items():
        X = dense_aggregate([u[n][0] for u in uploads], [u[n][1] for u in uploads], w)
        B_m, A_m = merge[n]
        assert torch.allclose(B @ A + B_m @ A_m, X, rtol=0, atol=1e-12)
        if name == "flora":
            assert not B.any() and not A.any() and B_m.shape[1] == sum(ranks)  # stacked: global rank sum r_i
        else:
            assert torch.allclose(B, sum(wi / 6 * u[n][0] for wi, u in zip(w, uploads)), rtol=0, atol=1e-12)
            assert torch.allclose(B_m @ A_m, X - B @ A, rtol=0, atol=1e-12)  # the residual of FedEx-LoRA


def test_flora_sends_no_reference_weighs_by_data_size_and_starts_each_round_from_a_fresh_lora():
    method = _method("flora", [2, 4])
    own, received = _uploads([4])[0], _uploads([4], seed=1)[0]
    assert method.downlink(received, 0) == {}
    assert method.weights([20, 20], [100, 300]) == [100.0, 300.0]
    first, second = method.start_round(received, own, 1, 0), method.start_round(received, own, 1, 1)
    for n, (d, k) in SHAPES.items():
        (B1, A1), (_, A2) = first[n], second[n]
        assert B1.shape == (d, 4) and not B1.any() and A1.shape == (4, k)
        assert float(A1.abs().max()) <= k**-0.5 and not torch.equal(A1, A2)  # PEFT's Kaiming bound 1/sqrt(k)


def test_fed_plora_draws_r_i_of_the_R_modules_per_client_and_round_reproducibly():
    method = _method("fed_plora", [1, 2, 4])
    draws = {(c, t): method.selection(c, t) for c in range(3) for t in range(40)}
    assert all(len(draws[c, t]) == [1, 2, 4][c] and len(set(draws[c, t])) == [1, 2, 4][c] for c, t in draws)
    assert all(draws[2, t] == [0, 1, 2, 3] for t in range(40))  # r_i = R trains every module
    assert {j for t in range(40) for j in draws[0, t]} == {0, 1, 2, 3}  # re-drawn each round
    again = _method("fed_plora", [1, 2, 4])
    assert all(again.selection(c, t) == draws[c, t] for c, t in draws)  # the server draws what the client drew
    other = METHODS["fed_plora"](FedPAConfig(), RankPlan.build(3, 4, client_ranks=[1, 2, 4]), seed=5)
    assert any(other.selection(1, t) != draws[1, t] for t in range(40))


def test_fed_plora_folds_the_undrawn_modules_so_a_client_starts_at_the_global_product():
    method = _method("fed_plora", [2, 4])
    received = _uploads([4], seed=3)[0]
    start, fold = method.start_round(received, {}, 0, 7), method.fold(received, 0, 7)
    assert method.fold(received, 1, 7) is None  # r_i = R: nothing to fold
    for n, (B, A) in received.items():
        assert start[n][0].shape[1] == 2 and fold[n][0].shape[1] == 2
        torch.testing.assert_close(start[n][0] @ start[n][1] + fold[n][0] @ fold[n][1], B @ A, rtol=0, atol=1e-12)


def test_fed_plora_averages_each_module_over_the_clients_that_trained_it():
    ranks = [1, 2, 2, 4]
    method = _method("fed_plora", ranks)
    # a round where clients 1-3 leave some module to client 4 alone (so the means differ from a plain average)
    rnd = next(t for t in range(100) if len({j for c in range(3) for j in method.selection(c, t)}) < 4)
    previous = _uploads([4], seed=9)[0]
    trained = _uploads(ranks, seed=4)
    uploads = [
        method.complete_upload({n: {"B": B, "A": A} for n, (B, A) in t.items()}, previous, c, rnd)
        for c, t in enumerate(trained)
    ]
    new, _ = method.aggregate(uploads, method.weights([5, 1, 1, 1], [None] * 4), [0, 1, 2, 3], torch.Generator(), rnd)
    # Independent reference: loop over modules and the clients that drew each one
    drawn = [method.selection(c, rnd) for c in range(4)]
    for n, (B_new, A_new) in new.items():
        for j in range(4):
            Q = [(c, d.index(j)) for c, d in enumerate(drawn) if j in d]
            b = sum(trained[c][n][0][:, pos] for c, pos in Q) / len(Q)
            a = sum(trained[c][n][1][pos] for c, pos in Q) / len(Q)
            torch.testing.assert_close(B_new[:, j], b, rtol=0, atol=1e-12)
            torch.testing.assert_close(A_new[j], a, rtol=0, atol=1e-12)
    # a module that nobody trained stays the global one, bit for bit
    alone = _method("fed_plora", [1, 4])
    kept = [j for j in range(4) if j not in alone.selection(0, rnd)]
    upload = alone.complete_upload({n: {"B": B, "A": A} for n, (B, A) in trained[0].items()}, previous, 0, rnd)
    new, _ = alone.aggregate([upload], [1.0], [0], torch.Generator(), rnd)
    assert all(torch.equal(new[n][0][:, kept], B[:, kept]) and torch.equal(new[n][1][kept], A[kept])
               for n, (B, A) in previous.items())  # fmt: skip


def test_fed_plora_refuses_an_upload_of_the_wrong_rank_and_per_client_references():
    method = _method("fed_plora", [2, 4])
    previous = _uploads([4])[0]
    wrong = {n: {"B": B, "A": A} for n, (B, A) in _uploads([3])[0].items()}
    with pytest.raises(ValueError, match=r"client #1 trains the 2 modules \[\d, \d\] in round 0"):
        method.complete_upload(wrong, previous, 0, 0)
    with pytest.raises(ValueError, match="fed_plora sends every client all R"):
        _method("fed_plora", [2, 4], reference_ranks=[2, 4])


def _cos(X, Y):
    return float((X * Y).sum() / (X.norm() * Y.norm()))


def test_lora_fair_corrects_B_toward_the_average_product_and_keeps_A_bar():
    uploads, w = _uploads([3, 3, 3], seed=2), [1.0, 2.0, 3.0]
    fair, _ = _method("lora_fair", [3, 3, 3]).aggregate(uploads, w, [0, 1, 2], torch.Generator())
    fedit, _ = _method("fedit", [3, 3, 3]).aggregate(uploads, w, [0, 1, 2], torch.Generator())
    for n, (B, A) in fair.items():
        X = dense_aggregate([u[n][0] for u in uploads], [u[n][1] for u in uploads], w)
        assert torch.equal(A, fedit[n][1])
        B_bar, A_bar = fedit[n]
        assert _cos(X, B @ A) > _cos(X, B_bar @ A_bar)
        assert float((X - B @ A).norm()) < float((X - fedit[n][0] @ fedit[n][1]).norm())  # E_agg below FedIT's


def _ravan(ranks, seed=-1, **options):
    get_method("ravan")
    plan = RankPlan.build(len(ranks), max(ranks), client_ranks=ranks)
    cfg = FedPAConfig(seed=seed, methods={"ravan": METHODS["ravan"].options(**options)})
    method = METHODS["ravan"](cfg, plan)
    method.bind(SHAPES)
    return method


def test_ravan_budgets_heads_and_head_rank_from_the_client_ranks():
    method = _ravan([2, 4, 16])
    assert method.heads == [1, 2, 8] and method.H == 8  # the FedPA-LoRA paper's h_i for r_i 2, 4, 16
    for name, (d, k) in SHAPES.items():  # no more trainable parameters than the client's rank-r_i LoRA
        r_h = method.ranks[name]
        assert all(K * r_h**2 <= r * (d + k) < K * (r_h + 1) ** 2 or K * (r_h + 1) ** 2 > r * (d + k)
                   for r, K in zip([2, 4, 16], method.heads))  # fmt: skip
        assert any(K * (r_h + 1) ** 2 > r * (d + k) for r, K in zip([2, 4, 16], method.heads))  # the largest
    assert _ravan([2, 4], heads=[3, 1], head_rank=2).heads == [3, 1]
    assert _ravan([2, 4], head_rank=2).ranks == {"q": 2, "v": 2}
    with pytest.raises(ValueError, match="ravan sends every client all of its heads"):
        METHODS["ravan"](FedPAConfig(), RankPlan.build(2, 4, client_ranks=[2, 4], reference_ranks=[2, 4]))


def test_ravan_expand_is_the_sum_of_the_scaled_head_products_on_fixed_bases():
    method = _ravan([2, 4])
    g = torch.Generator().manual_seed(1)
    state = {n: (torch.randn(2, method.ranks[n], method.ranks[n], generator=g), torch.rand(2, generator=g))
             for n in SHAPES}  # fmt: skip
    for n, (B, A) in method.expand(state).items():
        B_b, A_b = method.bases(n)
        r = method.ranks[n]
        dense = sum(state[n][1][h] * B_b[:, h * r:(h + 1) * r] @ state[n][0][h] @ A_b[h * r:(h + 1) * r]
                    for h in range(2))  # fmt: skip
        torch.testing.assert_close(B @ A, dense, rtol=1e-5, atol=1e-6)
    # the bases are the same on every worker (drawn from the seed and the module's name) and differ by seed
    again = _ravan([2, 4])
    assert all(torch.equal(method.bases(n)[0], again.bases(n)[0]) for n in SHAPES)
    assert not torch.equal(method.bases("q")[0], _ravan([2, 4], seed=3).bases("q")[0])
    assert not torch.equal(method.bases("q")[0][:, :1], method.bases("v")[0][:, :1])


def test_ravan_averages_each_head_over_the_clients_that_trained_it_and_is_exact_there():
    method = _ravan([1, 2, 2, 4])  # K_i = 1, 2, 2, 4 of H = 4 heads
    rnd = next(t for t in range(100) if len({h for c in range(3) for h in method.selection(c, t)}) < 4)
    init = {n: (H.double(), s.double()) for n, (H, s) in method.init_global(SHAPES, None).items()}
    global_ = _state_uploads(method, init, 0, seed=7)  # a non-zero global
    uploads = [_state_uploads(method, global_, c, seed=2, rnd=rnd) for c in range(4)]
    new, spectra = method.aggregate(uploads, method.weights([5, 1, 1, 1], [None] * 4), range(4), None, rnd)
    assert spectra == {}
    drawn = [method.selection(c, rnd) for c in range(4)]
    for n, (H_new, s_new) in new.items():
        assert torch.equal(s_new, torch.ones(4, dtype=s_new.dtype))
        B_b, A_b = (t.double() for t in method.bases(n))
        r = method.ranks[n]
        for h in range(4):
            C = [c for c in range(4) if h in drawn[c]]  # the paper's C_h, unweighted
            want = sum(uploads[c][n][0][h] for c in C) / len(C)
            torch.testing.assert_close(H_new[h], want, rtol=0, atol=1e-12)
            # exact: head h's product is the mean of the trainers' head products
            Bh, Ah = B_b[:, h * r : (h + 1) * r], A_b[h * r : (h + 1) * r]
            mean = sum(Bh @ uploads[c][n][0][h] @ Ah for c in C) / len(C)
            torch.testing.assert_close(Bh @ H_new[h] @ Ah, mean, rtol=0, atol=1e-12)
    alone = _ravan([1, 4])
    kept = [h for h in range(4) if h not in alone.selection(0, rnd)]
    upload = _state_uploads(alone, global_, 0, rnd=rnd)
    new, _ = alone.aggregate([upload], [1.0], [0], None, rnd)
    assert all(torch.equal(new[n][0][kept], H[kept]) for n, (H, _) in global_.items())  # untrained: kept


def test_ravan_uploads_the_scaled_cores_of_its_heads_only_and_refuses_other_shapes():
    method = _ravan([1, 4])
    global_ = method.init_global(SHAPES, None)
    local = {n: (torch.randn(H.shape), torch.full(s.shape, 2.0)) for n, (H, s) in global_.items()}
    start = method.start_round(local, global_, 0, 3)  # from what it received, its scales back at 1
    assert all(torch.equal(start[n][0], H) and torch.equal(start[n][1], torch.ones(4)) for n, (H, _) in local.items())
    payload = method.upload_payload(method.before_upload(local, global_, 3), 0, 3)
    chosen = method.selection(0, 3)
    assert len(chosen) == 1
    for n, parts in payload.items():
        assert set(parts) == {"B"} and torch.equal(parts["B"], 2.0 * local[n][0][chosen])
    wrong = {n: {"B": torch.zeros(2, *H.shape[1:])} for n, (H, _) in global_.items()}
    with pytest.raises(ValueError, match=r"client #1 trains the heads \[\d\] in round 3"):
        method.complete_upload(wrong, global_, 0, 3)
