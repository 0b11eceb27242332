"""fs_fedpa.lora against PEFT's own forward: any per-module rank, scaling and effective factors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fs_fedpa import lora


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(12, 10)
        self.v = nn.Linear(12, 8)

    def forward(self, x):
        return self.q(x).sum(-1) + self.v(x).sum(-1)


def _peft_model(r=4, alpha=8, rslora=False):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["q", "v"], use_rslora=rslora, lora_dropout=0.0)
    return peft.get_peft_model(_Two(), cfg)


def _delta(model, x):
    """The adapter's contribution, as PEFT computes it: output with LoRA minus output without."""
    with torch.no_grad():
        with_lora = model(x)
        with model.disable_adapter():
            base = model(x)
    return with_lora - base


@pytest.mark.parametrize("rslora", [False, True])
def test_set_factors_at_another_rank_computes_the_scaled_product(rslora):
    # Prepare
    model = _peft_model(rslora=rslora)
    layers = lora.lora_layers(model)
    g = torch.Generator().manual_seed(1)
    factors = {
        name: (torch.randn(layer.out_features, r, generator=g), torch.randn(r, layer.in_features, generator=g))
        for (name, layer), r in zip(layers.items(), (2, 7))
    }
    x = torch.randn(5, 12, generator=g)
    # Execute
    lora.set_factors(model, factors)
    # Assert: PEFT's forward now adds x (s B A)^T with s = alpha / r (alpha / sqrt(r) for rsLoRA)
    expected = 0
    for (B, A), r in zip(factors.values(), (2, 7)):
        s = 8 / r**0.5 if rslora else 8 / r
        expected = expected + (x @ (s * B @ A).T).sum(-1)
    torch.testing.assert_close(_delta(model, x), expected, rtol=1e-5, atol=1e-5)
    assert [B.shape[1] for B, _ in lora.get_factors(model).values()] == [2, 7]
    assert all(p.requires_grad for B, A in lora.get_factors(model).values() for p in (B, A))


def _applied_delta(x, factors):
    """Independent reference: the adapter contribution of applied factors, x (B A)^T summed as _Two does."""
    return sum((x @ (B @ A).T).sum(-1) for B, A in factors.values())


@pytest.mark.parametrize("rslora", [False, True])
def test_scaling_applied_factors_are_the_update_peft_applies(rslora):
    # Prepare
    model = _peft_model(r=4, rslora=rslora)
    g = torch.Generator().manual_seed(2)
    for B, _ in lora.get_factors(model).values():
        with torch.no_grad():
            B.copy_(torch.randn(B.shape, generator=g))
    x = torch.randn(5, 12, generator=g)
    # Execute
    applied = lora.Scaling.of(model).applied(lora.copy_factors(lora.get_factors(model)))
    # Assert
    torch.testing.assert_close(_delta(model, x), _applied_delta(x, applied), rtol=1e-5, atol=1e-5)
    back = lora.Scaling.of(model).raw(applied)
    for name, (B, _) in lora.get_factors(model).items():
        torch.testing.assert_close(back[name][0], B.detach())


def _random_factors(model, r, g):
    """Random ``(B: (d, r), A: (r, k))`` for every LoRA module of ``model``."""
    return {
        n: (torch.randn(layer.out_features, r, generator=g), torch.randn(r, layer.in_features, generator=g))
        for n, layer in lora.lora_layers(model).items()
    }


@pytest.mark.parametrize("rslora", [False, True])
def test_client_space_loads_an_applied_pair_of_another_rank_as_the_same_update(rslora):
    # Prepare: a rank-2 client evaluates a rank-5 applied reference X
    model = _peft_model(r=4, rslora=rslora)
    space = lora.ClientSpace(lora.Scaling.of(model), rank=2)
    g = torch.Generator().manual_seed(4)
    X = _random_factors(model, 5, g)
    x = torch.randn(5, 12, generator=g)
    # Execute
    lora.set_factors(model, space.into_model(X)[0])
    # Assert
    torch.testing.assert_close(_delta(model, x), _applied_delta(x, X), rtol=1e-4, atol=1e-4)


def test_client_space_round_trips_applied_factors_bit_for_bit_where_the_scale_is_a_power_of_two():
    # Prepare: alpha 8 at rank 4 (s = 2, the protocol's) and at rank 3 (s = 8/3)
    g = torch.Generator().manual_seed(5)
    for r_i, exact in ((4, True), (2, True), (3, False)):
        model = _peft_model(r=4)
        space = lora.ClientSpace(lora.Scaling.of(model), rank=r_i)
        own = _random_factors(model, r_i, g)
        x = torch.randn(5, 12, generator=g)
        # Execute: into the model and out again
        lora.set_factors(model, space.into_model(own)[0])
        back = space.from_model(lora.copy_factors(lora.get_factors(model)))
        # Assert: PEFT applies the applied update; the pair comes back bit for bit where 8 / r_i is a power of two
        torch.testing.assert_close(_delta(model, x), _applied_delta(x, own), rtol=1e-5, atol=1e-5)
        same = all(torch.equal(back[n][0], B) and torch.equal(back[n][1], A) for n, (B, A) in own.items())
        assert same or not exact
        for n, (B, A) in own.items():
            torch.testing.assert_close(back[n][0], B, rtol=1e-6, atol=0)


def test_the_alignment_reference_goes_into_the_frame_of_the_models_rank_r_i_factors():
    # A rank-3 applied reference for a rank-2 client: X / s_i, whatever the reference's own rank
    model = _peft_model(r=4, alpha=8)
    space = lora.ClientSpace(lora.Scaling.of(model), rank=2)
    X = _random_factors(model, 3, torch.Generator().manual_seed(6))
    _, reference = space.into_model({}, X)
    for n, (B, A) in X.items():
        assert torch.equal(reference[n][0], B / 4.0) and reference[n][1] is A  # s(2) = 8 / 2


@pytest.mark.parametrize(("rslora", "alpha"), [(False, 8), (False, 3), (True, 8)])
def test_penalty_weight_is_the_squared_scale_ratio_whatever_alpha(rslora, alpha):
    model = _peft_model(r=4, alpha=alpha, rslora=rslora)
    scaling = lora.Scaling.of(model)
    for r_i in (2, 4, 16):
        expected = (4 / r_i) if rslora else (4 / r_i) ** 2  # (s(r_i) / s(4))^2
        assert lora.ClientSpace(scaling, r_i).penalty_weight(4) == pytest.approx(expected)


def test_set_factors_copies_and_rejects_misfits():
    model = _peft_model()
    name = next(iter(lora.lora_layers(model)))
    B, A = torch.ones(10, 3), torch.ones(3, 12)
    lora.set_factors(model, {name: (B, A)})
    B.add_(1)
    assert torch.equal(lora.get_factors(model)[name][0], torch.ones(10, 3))
    with pytest.raises(ValueError, match=r"do not fit the layer \(10 x 12\)"):
        lora.set_factors(model, {name: (torch.ones(9, 3), torch.ones(3, 12))})
    with pytest.raises(KeyError, match="no LoRA module named"):
        lora.set_factors(model, {"nope": (B, A)})


def test_copy_factors_detaches_and_clones():
    model = _peft_model()
    live = lora.get_factors(model)
    copied = lora.copy_factors(live)
    for name, (B, A) in copied.items():
        assert not B.requires_grad and B.data_ptr() != live[name][0].data_ptr()
        assert not A.requires_grad and torch.equal(A, live[name][1].detach())


def test_base_offsets_add_to_the_kept_base_weight_and_setting_them_again_does_not_accumulate():
    model = _peft_model()
    layers = lora.lora_layers(model)
    w0 = {n: layer.get_base_layer().weight.detach().clone() for n, layer in layers.items()}
    lora.keep_base(model)
    g = torch.Generator().manual_seed(3)
    offsets = {n: torch.randn(w.shape, generator=g) for n, w in w0.items()}
    x = torch.randn(5, 12, generator=g)
    with torch.no_grad(), model.disable_adapter():
        plain = model(x)
    for _ in range(2):  # workers sharing one model set their offsets at every turn
        lora.set_base_offsets(model, offsets)
    for n, layer in layers.items():
        assert torch.equal(layer.get_base_layer().weight, w0[n] + offsets[n])
    with torch.no_grad(), model.disable_adapter():
        shifted = model(x)
    expected = plain + (x @ offsets[next(n for n in layers if n.endswith("q"))].T).sum(-1)
    expected = expected + (x @ offsets[next(n for n in layers if n.endswith("v"))].T).sum(-1)
    assert torch.allclose(shifted, expected, atol=1e-5)
    lora.set_base_offsets(model, {n: torch.zeros_like(o) for n, o in offsets.items()})
    assert all(torch.equal(layer.get_base_layer().weight, w0[n]) for n, layer in layers.items())
    lora.set_base_offsets(model, offsets)
    lora.set_base_offsets(model, {})  # a module it does not name goes back to W_0
    assert all(torch.equal(layer.get_base_layer().weight, w0[n]) for n, layer in layers.items())
    with pytest.raises(KeyError, match="no LoRA module"):
        lora.set_base_offsets(model, {"nowhere": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="does not fit"):
        lora.set_base_offsets(model, {next(iter(layers)): torch.zeros(3, 3)})


def test_row_gate_mixes_the_two_adapters_per_input_row():
    # Prepare: both adapters as one of rank 2 + 3; rows gated by g and 1 - g
    model, g = _peft_model(r=4), torch.Generator().manual_seed(3)
    first, second = _random_factors(model, 2, g), _random_factors(model, 3, g)
    both = {n: (torch.cat([first[n][0], second[n][0]], 1), torch.cat([first[n][1], second[n][1]], 0)) for n in first}
    x, weights = torch.randn(4, 12, generator=g), torch.tensor([0.0, 0.3, -0.2, 1.0])
    lora.set_factors(model, both)
    gate = lora.RowGate(model, 2)
    gate.g = weights
    # Execute
    got = _delta(model, x)
    gate.remove()
    # Assert: row by row, the model loaded with (g B_1 | (1 - g) B_2) and no gate, an independent forward
    for row, w in enumerate(weights.tolist()):
        lora.set_factors(
            model, {n: (torch.cat([w * B[:, :2], (1 - w) * B[:, 2:]], 1), A) for n, (B, A) in both.items()}
        )
        torch.testing.assert_close(got[row], _delta(model, x[row : row + 1])[0], rtol=1e-5, atol=1e-5)
    gate.g = torch.zeros(2)  # removed: no effect, even with a wrong shape
    lora.set_factors(model, both)
    assert _delta(model, x).shape == (4,)


def test_row_gate_refuses_weights_that_do_not_fit_the_batch():
    model = _peft_model()
    gate = lora.RowGate(model, 2)
    gate.g = torch.zeros(3)
    with pytest.raises(ValueError, match="3 weights for a batch of 4 rows"):
        model(torch.randn(4, 12))


def test_heads_apply_the_scaled_head_products_on_frozen_bases_and_train_only_the_chosen_heads():
    # Prepare: H = 3 heads of rank 2 on q (10 x 12) and v (8 x 12)
    model, g = _peft_model(r=4), torch.Generator().manual_seed(5)
    shapes = {n: (layer.out_features, layer.in_features) for n, layer in lora.lora_layers(model).items()}
    bases = {n: (torch.randn(d, 6, generator=g), torch.randn(6, k, generator=g)) for n, (d, k) in shapes.items()}
    heads = {n: (torch.randn(3, 2, 2, generator=g), torch.rand(3, generator=g) + 0.5) for n in shapes}
    x = torch.randn(5, 12, generator=g)
    # Execute
    lora.set_heads(model, bases, heads, trainable=[0, 2])
    layers = lora.lora_layers(model)
    assert not any(w.requires_grad for layer in layers.values() for w in (layer.lora_A["default"].weight,
                                                                          layer.lora_B["default"].weight))  # fmt: skip
    model(x).sum().backward()
    got = _delta(model, x)  # (PEFT's disable_adapter makes lora_A/lora_B trainable again on exit)
    # Assert: against the dense sum_h s_h B_h H_h A_h, and its autograd gradient for the cores and scales
    want = 0
    for n, (B, A) in bases.items():
        cores = heads[n][0].clone().requires_grad_()
        scales = heads[n][1].clone().requires_grad_()
        dW = sum(scales[h] * B[:, 2 * h : 2 * h + 2] @ cores[h] @ A[2 * h : 2 * h + 2] for h in range(3))
        out = (x @ dW.T).sum()
        out.backward()
        want = want + (x @ dW.T).sum(-1).detach()
        layer = lora.lora_layers(model)[n]
        for h in range(3):
            core, scale = layer.fedpa_heads.cores[h], layer.fedpa_heads.scales[h]
            if h == 1:  # frozen: no gradient, so no optimizer can move it
                assert not core.requires_grad and core.grad is None and scale.grad is None
            else:
                torch.testing.assert_close(core.grad, cores.grad[h], rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(scale.grad, scales.grad[h], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    read = lora.get_heads(model)
    assert all(torch.equal(read[n][0], heads[n][0]) and torch.equal(read[n][1], heads[n][1]) for n in heads)
    with pytest.raises(ValueError, match="do not fit bases of rank 6"):
        lora.set_heads(model, bases, {n: (torch.zeros(2, 2, 2), torch.ones(2)) for n in shapes})


def test_built_rank_is_the_rank_peft_built_after_the_factors_change_rank():
    # a resumed server loads its global into the model the clients share, at another rank (issue 88)
    model = _peft_model(r=4)
    lora.set_factors(model, _random_factors(model, 16, torch.Generator().manual_seed(0)))
    layers = lora.lora_layers(model)
    assert {int(layer.r["default"]) for layer in layers.values()} == {16}
    assert {lora.built_rank(layer) for layer in layers.values()} == {4}
