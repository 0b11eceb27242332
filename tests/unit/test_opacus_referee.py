"""Opacus as the referee of the plugin's DP-SGD (no FederatedScope): the per-example gradients of the batched taps
(fs_fedpa.privacy.per_example) equal Opacus's GradSampleModule grad samples on a LoRA BERT classifier and a LoRA Llama,
padded batches included; and one DP-SGD step from them (clip, sum, noise, divide by b) equals a step of Opacus's
DPOptimizer with the same records, clip and injected noise. Opacus is a test dependency only (the test extra)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

opacus = pytest.importorskip("opacus", reason="opacus (the test extra) is not installed")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from fs_fedpa.privacy.mechanism import gaussian  # noqa: E402
from fs_fedpa.privacy.per_example import LinearTaps, clipped_sum, linear_owners, per_example_grads  # noqa: E402


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, num_labels=2, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, max_position_embeddings=32)  # fmt: skip
    base = transformers.BertForSequenceClassification(config)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4, target_modules=["query", "value"])
    model = peft.get_peft_model(base, lora)
    for name, p in model.named_parameters():  # B = 0 at init would make every B gradient's A part vanish
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    return model.train()  # Opacus records activations in training mode only; no dropout anywhere here


def _llama():
    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=60, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    base = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, lora)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    return model.train()  # Opacus records activations in training mode only; no dropout anywhere here


def _padded_batch(b: int, seed: int):
    """Token ids with right padding of different lengths, and the attention mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 5, 9, 3, 12, 7][:b])
    ids = torch.randint(1, 60, (b, 12), generator=g)
    mask = (torch.arange(12)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def _seqcls_losses(model, ids, mask, y):
    return nn.functional.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, y, reduction="none")


def _causal_losses(model, ids, mask):
    """Each record's loss is the mean over its own label tokens (what the plugin's record_losses rebuilds)."""
    labels = ids.masked_fill(mask == 0, -100)
    logits = model(input_ids=ids, attention_mask=mask).logits
    tokens = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                                         reduction="none").view(ids.shape[0], -1)  # fmt: skip
    return tokens.sum(1) / (labels[:, 1:] != -100).sum(1).clamp(min=1)


def _taps(model, losses_of):
    """Per-example gradients of every trainable tensor by the plugin's taps."""
    params = [p for p in model.parameters() if p.requires_grad]
    owners, why = linear_owners(model, params)
    assert owners is not None, why
    with LinearTaps([m for m, _ in owners]) as taps:
        losses = losses_of(model)
    grads = torch.autograd.grad(losses.sum(), [*params, *taps.outputs()], allow_unused=True)
    found = per_example_grads(taps, owners, grads[len(params) :], losses.shape[0])
    assert found is not None
    return params, found


def _opacus(model, losses_of):
    """Opacus's grad samples of the same tensors: its hooks on a copy, the loss a sum over records."""
    module = opacus.GradSampleModule(model, loss_reduction="sum")
    losses_of(module).sum().backward()
    return [p.grad_sample for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_the_taps_per_example_gradients_equal_opacus_grad_samples(kind):
    b = 6
    ids, mask = _padded_batch(b, seed=2)
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    model = _bert() if kind == "bert" else _llama()
    losses_of = (lambda m: _seqcls_losses(m, ids, mask, y)) if kind == "bert" else (lambda m: _causal_losses(m, ids, mask))
    params, ours = _taps(model, losses_of)
    theirs = _opacus(copy.deepcopy(model), losses_of)
    assert len(ours) == len(theirs) == len(params) and len(params) >= 8  # every LoRA A and B (and the head)
    for mine, ref in zip(ours, theirs):
        assert mine.shape == ref.shape
        assert torch.allclose(mine, ref.float(), rtol=1e-4, atol=1e-6), float((mine - ref).abs().max())


def test_one_dp_step_equals_opacus_dpoptimizer_with_the_same_noise(monkeypatch):
    """b = 6 records, C = 0.05 (every record clipped), z = 1.3, plain SGD: the plugin's step is
    p - lr (sum_j c_j g_j + N(0, (z C)^2)) / b with the noise drawn by fs_fedpa.privacy.mechanism.gaussian; Opacus's
    DPOptimizer is handed those same draws through its noise generator. Opacus divides by ||g_j|| + 1e-6 when it
    clips, hence the tolerance."""
    from opacus.optimizers import optimizer as opacus_optimizer

    b, C, z, lr = 6, 0.05, 1.3, 0.5
    ids, mask = _padded_batch(b, seed=3)
    y = torch.tensor([1, 1, 0, 0, 1, 0])
    model = _bert()
    reference = copy.deepcopy(model)

    def losses_of(m):
        return _seqcls_losses(m, ids, mask, y)

    params, per_example = _taps(model, losses_of)
    total, scales = clipped_sum(per_example, C)
    assert max(scales) < 1.0  # the clip binds on every record
    generator = torch.Generator().manual_seed(7)
    noise = [gaussian(p.shape, z * C, generator, p) for p in params]
    with torch.no_grad():
        ours = [p - lr * (t.float() + n) / b for p, t, n in zip(params, total, noise)]

    draws = iter(noise)
    monkeypatch.setattr(opacus_optimizer, "_generate_noise", lambda std, reference, **kw: next(draws))
    # Opacus's mean reduction: its grad samples are rescaled to per-record gradients and the step divides the noisy
    # sum by the expected batch size, the plugin's (sum + noise) / b
    module = opacus.GradSampleModule(reference, loss_reduction="mean")
    trainable = [p for p in reference.parameters() if p.requires_grad]
    optimizer = opacus.optimizers.DPOptimizer(torch.optim.SGD(trainable, lr=lr), noise_multiplier=z,
                                              max_grad_norm=C, expected_batch_size=b, loss_reduction="mean")  # fmt: skip
    optimizer.zero_grad()
    losses_of(module).mean().backward()
    optimizer.step()
    assert next(draws, None) is None  # Opacus drew exactly one noise tensor per parameter
    for mine, theirs in zip(ours, trainable):
        assert torch.allclose(mine, theirs.detach(), rtol=1e-5, atol=1e-7), float((mine - theirs).abs().max())


@pytest.mark.parametrize("rate,z,steps,delta", [(16 / 6424, 0.9375, 210, 1e-5), (0.01, 1.1, 1000, 1e-5),
                                                (0.1, 2.0, 30, 1e-6), (1.0, 3.0, 5, 1e-5)])  # fmt: skip
def test_the_literature_reading_of_epsilon_equals_opacus_rdp_accountant(rate, z, steps, delta):
    """Poisson sampling at rate b/n_i, add/remove adjacency, multiplier z: the convention of Opacus and the DP
    fine-tuning papers, which docs/privacy.md quotes beside the run's own (fixed-size, replace-one) epsilon. The first
    case is the protocol's client 1 (n 6424, b 16, 210 steps): about 0.92, where the run's own reading says 7.88."""
    pytest.importorskip("dp_accounting")
    from opacus.accountants import RDPAccountant

    from fs_fedpa.privacy.accountant import poisson_add_remove_epsilon

    accountant = RDPAccountant()
    accountant.history = [(z, rate, steps)]
    assert poisson_add_remove_epsilon(rate, z, steps, delta) == pytest.approx(accountant.get_epsilon(delta), rel=1e-6)


def test_the_docs_quote_the_literature_reading_of_the_protocols_dp_sgd_runs():
    """docs/privacy.md and docs/compare.md quote 'ε ≈ 0.95, 0.91 to 1.29 across clients' for the protocol's DP-SGD
    finals: Opacus's RDP accountant on every client of every committed final gives that median and range."""
    import json
    import statistics
    from pathlib import Path

    from opacus.accountants import RDPAccountant

    root = Path(__file__).resolve().parents[2]
    runs = sorted((root / "docs" / "reference" / "sst2_protocol" / "runs" / "privacy").glob("*_dp_s*.json"))
    values = []
    for path in runs:
        for v in (json.loads(path.read_text())["privacy"].get("dp_clients") or {}).values():
            accountant = RDPAccountant()
            accountant.history = [(v["noise_multiplier"], v["b"] / v["n"], v["steps"])]
            values.append(accountant.get_epsilon(v["delta"]))
    if not values:
        pytest.skip("no committed sample-level DP runs")
    text = "".join((root / "docs" / f).read_text() for f in ("privacy.md", "compare.md", "study/privacy_measured.md",
                                                             "study/verdict.md"))
    median, low, high = f"{statistics.median(values):.2f}", f"{min(values):.2f}", f"{max(values):.2f}"
    assert f"ε ≈ {median}" in text and f"{low} to {high}" in text and f"{low}–{high}" in text
