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


def test_effective_factors_reproduce_the_applied_update():
    model = _peft_model()
    scales = lora.scaling(model)
    eff = lora.effective(lora.get_factors(model), scales)
    for name, (B, A) in lora.get_factors(model).items():
        torch.testing.assert_close(eff[name][0] @ eff[name][1], scales[name] * B @ A)


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


def test_from_effective_inverts_effective_at_any_rank():
    model = _peft_model()
    layers = lora.lora_layers(model)
    g = torch.Generator().manual_seed(3)
    raw = {
        n: (torch.randn(layer.out_features, 3, generator=g), torch.randn(3, layer.in_features, generator=g))
        for n, layer in layers.items()
    }
    scales = {n: lora.scaling_for_rank(layer, 3) for n, layer in layers.items()}  # alpha / 3
    back = lora.from_effective(layers, lora.effective(raw, scales))
    for n, (B, A) in raw.items():
        torch.testing.assert_close(back[n][0], B)
        torch.testing.assert_close(back[n][1], A)
    assert scales[next(iter(scales))] == pytest.approx(8 / 3)
