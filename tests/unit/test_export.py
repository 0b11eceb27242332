"""fs_fedpa.export against PEFT's own loader and dense models built by hand: what a written adapter applies, the keys
it saves, the heads it carries, and FedDPA's per-input mix of two adapters."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa import export
from fs_fedpa.core.instance import instance_weights

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

H, ALPHA = 16, 8.0
QUERY, VALUE = "bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.attention.self.value"
FS = "model.base_model.model."  # how FS names a module of its PEFT-wrapped model
HEAD = {f"{FS}classifier.modules_to_save.default.weight": (2, H), f"{FS}classifier.modules_to_save.default.bias": (2,)}


def _bert():
    """A tiny BERT classifier, the same weights at every call, no dropout."""
    config = transformers.BertConfig(vocab_size=50, hidden_size=H, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, num_labels=2, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).eval()


def _applied(ranks: dict[str, int], seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {m: (torch.randn(H, r, generator=g), torch.randn(r, H, generator=g)) for m, r in ranks.items()}


def _head(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in HEAD.items()}


def _dense(deltas: dict[str, torch.Tensor], head: dict[str, torch.Tensor] | None = None):
    """Independent reference: the base model with ``W_0 + deltas[m]`` in module m and the head set by hand."""
    model = _bert()
    with torch.no_grad():
        for m, delta in deltas.items():
            model.get_submodule(m).weight += delta
        if head:
            model.classifier.weight.copy_(head[f"{FS}classifier.modules_to_save.default.weight"])
            model.classifier.bias.copy_(head[f"{FS}classifier.modules_to_save.default.bias"])
    return model


def _inputs(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, 6, dtype=torch.long)
    mask[0, 4:] = 0  # one padded row
    return {"input_ids": torch.randint(1, 50, (n, 6), generator=g), "attention_mask": mask}


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _product(applied) -> dict[str, torch.Tensor]:
    return {m: B @ A for m, (B, A) in applied.items()}


def _peft_deltas(model) -> dict[str, torch.Tensor]:
    """``get_delta_weight`` of every LoRA layer, by base-model path."""
    from peft.tuners.lora import LoraLayer

    return {export.module_path(n): layer.get_delta_weight("default") for n, layer in model.named_modules()
            if isinstance(layer, LoraLayer)}  # fmt: skip


def _write(path, applied, *, tensors=None, rslora=False, task_type="SEQ_CLS"):
    adapter = export.Adapter.from_applied(applied, ALPHA, rslora, tensors)
    export.write_adapter(path, adapter, base_model="tiny-bert", task_type=task_type)


# ----------------------------------------------------------------------------------------------- lora_of_dense
@settings(max_examples=60, deadline=None)
@given(
    d=st.integers(1, 12),
    k=st.integers(1, 12),
    rank=st.integers(1, 12),
    scale=st.integers(-3, 3),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_lora_of_dense_factors_a_product_at_its_true_rank(d, k, rank, scale, dtype, seed):
    # Arrange: U diag(s) V^T from Gaussian draws, singular values in [1, 2] (generic rank, never ill-conditioned)
    rho = min(rank, d, k)
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(d, rho, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(k, rho, generator=g, dtype=torch.float64))[0]
    s = 1 + torch.rand(rho, generator=g, dtype=torch.float64)
    delta = (10.0**scale * (U * s) @ V.T).to(dtype)
    # Act
    B, A = export.lora_of_dense(delta)
    # Assert
    assert B.dtype == A.dtype == dtype and B.shape == (d, rho) and A.shape == (rho, k)
    error = (B.double() @ A.double() - delta.double()).norm()
    assert error <= 20 * max(d, k) * torch.finfo(dtype).eps * delta.double().norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lora_of_dense_of_zero_is_one_zero_direction(dtype):
    B, A = export.lora_of_dense(torch.zeros(5, 3, dtype=dtype))
    assert B.shape == (5, 1) and A.shape == (1, 3)
    assert torch.equal(B @ A, torch.zeros(5, 3, dtype=dtype))


# ------------------------------------------------------------------------------------------------ module_path
@pytest.mark.parametrize(
    "name, path",
    [
        (f"{FS}{QUERY}", QUERY),
        (f"{FS}classifier.modules_to_save.default.weight", "classifier.weight"),
        (f"{FS}classifier.original_module.weight", "classifier.weight"),
        (f"base_model.model.{VALUE}.lora_A.weight", f"{VALUE}.lora_A.weight"),
    ],
)
def test_module_path_strips_the_peft_and_fs_wrappers(name, path):
    assert export.module_path(name) == path


def test_module_path_refuses_a_name_outside_a_peft_model():
    with pytest.raises(ValueError, match="not inside a PEFT model"):
        export.module_path(f"model.{QUERY}")


def test_scaling_is_alpha_over_r_or_over_sqrt_r_with_rslora():
    assert export.scaling(8, False, 4) == 2.0
    assert export.scaling(8, True, 4) == 4.0
    assert export.scaling(6, True, 9) == 2.0
    assert export.scaling(ALPHA, True, 3) == pytest.approx(ALPHA / math.sqrt(3), rel=1e-15)


# ------------------------------------------------------------------------------------------------ write_adapter
@pytest.mark.parametrize("rslora", [False, True])
def test_written_adapter_applies_the_applied_products_in_peft(tmp_path, rslora):
    # Arrange: two modules of different ranks (r and a rank_pattern entry)
    applied = _applied({QUERY: 2, VALUE: 3}, seed=1)
    _write(tmp_path, applied, rslora=rslora, task_type=None)
    # Act
    model = peft.PeftModel.from_pretrained(_bert(), str(tmp_path))
    # Assert: PEFT's own delta is B A, and the dense model computes the same logits
    deltas = _peft_deltas(model)
    assert sorted(deltas) == [QUERY, VALUE]
    for m, expected in _product(applied).items():
        torch.testing.assert_close(deltas[m], expected, rtol=1e-6, atol=1e-6)
    layer = model.get_submodule(f"base_model.model.{VALUE}")
    assert layer.r["default"] == 3
    assert layer.scaling["default"] == pytest.approx(ALPHA / math.sqrt(3) if rslora else ALPHA / 3)
    inputs = _inputs(3, seed=2)
    torch.testing.assert_close(_logits(model, inputs), _logits(_dense(_product(applied)), inputs), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("task_type, head", [(None, False), ("SEQ_CLS", True)])
def test_written_keys_and_shapes_are_what_peft_saves_itself(tmp_path, task_type, head):
    # Arrange: PEFT's own save of the same configuration (r 2, value at rank 3, a classifier head with SEQ_CLS)
    config = peft.LoraConfig(task_type=task_type, r=2, rank_pattern={"value": 3}, lora_alpha=ALPHA,
                             target_modules=["query", "value"])  # fmt: skip
    peft.get_peft_model(_bert(), config).save_pretrained(str(tmp_path / "peft"))
    tensors = export.saved_tensors(_head(4)) if head else None
    # Act
    _write(tmp_path / "ours", _applied({QUERY: 2, VALUE: 3}, seed=3), tensors=tensors, task_type=task_type)
    # Assert
    theirs, ours = (safetensors.load_file(str(tmp_path / d / export.WEIGHTS)) for d in ("peft", "ours"))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert any("classifier" in k for k in ours) == head


def test_seq_cls_adapter_with_a_head_loads_the_head_into_the_classifier(tmp_path):
    # Arrange
    applied, head = _applied({QUERY: 2, VALUE: 2}, seed=5), _head(6)
    _write(tmp_path, applied, tensors=export.saved_tensors(head))
    # Act
    model = peft.PeftModel.from_pretrained(_bert(), str(tmp_path))
    # Assert
    assert model.peft_config["default"].task_type == "SEQ_CLS"
    inputs = _inputs(3, seed=7)
    torch.testing.assert_close(_logits(model, inputs), _logits(_dense(_product(applied), head), inputs), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


def test_adapter_without_a_head_loads_without_task_and_takes_the_head_file(tmp_path):
    # Arrange
    applied, head = _applied({QUERY: 2, VALUE: 2}, seed=8), _head(9)
    _write(tmp_path / "adapter", applied)
    export.write_tensors(tmp_path / "head.safetensors", export.saved_tensors(head))
    model = peft.PeftModel.from_pretrained(_bert(), str(tmp_path / "adapter"))
    # Act
    saved = export.read_tensors(tmp_path / "head.safetensors")
    _, unexpected = model.load_state_dict(saved, strict=False)
    # Assert
    assert model.peft_config["default"].task_type is None
    assert sorted(saved) == ["base_model.model.classifier.bias", "base_model.model.classifier.weight"]
    assert unexpected == []
    inputs = _inputs(3, seed=10)
    torch.testing.assert_close(_logits(model, inputs), _logits(_dense(_product(applied), head), inputs), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


# ------------------------------------------------------------------------------------------------------- load
def _manifest(root, clients: dict, global_dir: str = "global", task_type: str = "SEQ_CLS") -> None:
    info = {"task_type": task_type, "global": {"adapter": global_dir}, "clients": clients}
    (root / export.MANIFEST).write_text(json.dumps(info))


def test_load_finds_the_global_model_and_the_global_at_a_clients_reference_rank(tmp_path):
    # Arrange: global/ at rank 4, global_r2/ at rank 2 (any rank-2 adapter will do), a head; client 2 in its own file
    big, small, head = _applied({QUERY: 4, VALUE: 4}, seed=11), _applied({QUERY: 2, VALUE: 2}, seed=12), _head(13)
    _write(tmp_path / "global", big)
    _write(tmp_path / "global_r2", small)
    export.write_tensors(tmp_path / "heads" / "client_1.safetensors", export.saved_tensors(head))
    paper = {"paper": {"global": True, "head": "heads/client_1.safetensors"}, "rank": 2, "reference_rank": 2}
    _manifest(tmp_path, {"1": paper})
    (tmp_path / "export_client_2.json").write_text(json.dumps({"2": {**paper, "reference_rank": 4}}))
    inputs = _inputs(2, seed=14)
    # Act
    models = {c: export.load(_bert(), tmp_path, client=c) for c in (None, 1, 2)}
    # Assert
    torch.testing.assert_close(_logits(models[None], inputs), _logits(_dense(_product(big)), inputs))
    torch.testing.assert_close(_logits(models[1], inputs), _logits(_dense(_product(small), head), inputs))
    torch.testing.assert_close(_logits(models[2], inputs), _logits(_dense(_product(big), head), inputs))


def test_load_refuses_unknown_clients_protocols_and_directories(tmp_path):
    _write(tmp_path / "global", _applied({QUERY: 2, VALUE: 2}, seed=15))
    _manifest(tmp_path, {"3": {"paper": {"global": True, "head": None}, "rank": 2, "reference_rank": 2}})
    with pytest.raises(ValueError, match=r"client 7 was not exported \(clients: \['3'\]\)"):
        export.load(_bert(), tmp_path, client=7)
    with pytest.raises(ValueError, match="client 3 has no 'local' model"):
        export.load(_bert(), tmp_path, client=3, protocol="local")
    with pytest.raises(ValueError, match="no export.json"):
        export.load(_bert(), tmp_path / "global", client=3)


# ------------------------------------------------------------------------------------------------ InstanceMix
R, r = 3, 2


def _mix_export(root, task_type="SEQ_CLS", global_ranks=(R, R)):
    """A FedDPA client export: global adapter at rank R, personal at rank r, mixed with w 0.5. Returns the root and
    both adapters' products."""
    glob = _applied(dict(zip((QUERY, VALUE), global_ranks)), seed=16)
    personal = _applied({QUERY: r, VALUE: r}, seed=17)
    _write(root / "g", glob)
    _write(root / "p", personal)
    mix = {"mix": {"global": "g", "personal": "p", "w": 0.5}, "head": None}
    _manifest(root, {"1": {"paper": mix, "rank": r, "reference_rank": R}}, global_dir="g", task_type=task_type)
    return root, _product(glob), _product(personal)


def test_instance_mix_applies_the_weighted_sum_of_both_adapters_per_row(tmp_path):
    # Arrange
    root, d_g, d_l = _mix_export(tmp_path)
    mix = export.load(_bert(), root, client=1)
    inputs, g = _inputs(3, seed=18), torch.tensor([0.9, -0.3, 0.25])
    # Act
    with torch.no_grad():
        logits = mix(g=g, **inputs).logits
    # Assert: row b alone through W_0 + g_b Delta_g + (1 - g_b) Delta_l
    assert isinstance(mix, export.InstanceMix)
    for b, gb in enumerate(g.tolist()):
        dense = _dense({m: gb * d_g[m] + (1 - gb) * d_l[m] for m in d_g})
        row = {k: v[b : b + 1] for k, v in inputs.items()}
        torch.testing.assert_close(logits[b : b + 1], _logits(dense, row), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("task_type", ["SEQ_CLS", "CAUSAL_LM"])
def test_instance_mix_weights_are_the_cosines_under_the_personal_adapter(tmp_path, task_type):
    # Arrange: emb and refs from a dense model with only Delta_l, at [CLS] (a classifier) or the last attended token
    root, _, d_l = _mix_export(tmp_path, task_type)
    mix = export.load(_bert(), root, client=1)
    inputs, references = _inputs(2, seed=19), _inputs(6, seed=20)  # 3 references per row
    personal = _dense(d_l)

    def state(batch):
        with torch.no_grad():
            hidden = personal(**batch, output_hidden_states=True).hidden_states[-1]
        if task_type == "SEQ_CLS":
            return hidden[:, 0]
        return hidden[torch.arange(len(hidden)), batch["attention_mask"].sum(1) - 1]  # right padding

    expected = instance_weights(state(inputs), state(references).view(2, 3, H), 0.5)
    # Act
    got = mix.weights(inputs, references)
    with torch.no_grad():
        by_refs, by_g = mix(references=references, **inputs).logits, mix(g=expected, **inputs).logits
    # Assert
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(by_refs, by_g, rtol=1e-5, atol=1e-6)
    assert mix.gate.g is None


def test_instance_mix_refuses_a_forward_without_weights_and_global_ranks_that_differ(tmp_path):
    mix = export.load(_bert(), _mix_export(tmp_path / "ok")[0], client=1)
    with pytest.raises(ValueError, match="needs references"):
        mix(**_inputs(2, seed=21))
    with pytest.raises(ValueError, match=r"global adapter's ranks differ between modules \(\[2, 3\]\)"):
        export.load(_bert(), _mix_export(tmp_path / "uneven", global_ranks=(3, 2))[0], client=1)


def test_load_warns_when_the_base_given_is_not_the_one_trained_on():
    """An adapter trained on an NF4 base, loaded onto a float base (or onto another model), behaves differently
    without a word: check_base names both differences."""
    from types import SimpleNamespace

    from fs_fedpa.export import check_base

    info = {"base_model": "/models/MiniLM-L6", "base_quantization": "nf4"}
    plain = SimpleNamespace(config=SimpleNamespace(_name_or_path="/elsewhere/MiniLM-L6"), hf_quantizer=None)
    with pytest.warns(UserWarning, match="'nf4' quantization, and the base given is not quantized"):
        assert len(check_base(plain, info)) == 1  # same name in another folder: fine
    other = SimpleNamespace(config=SimpleNamespace(_name_or_path="bert-base"), hf_quantizer=object())
    with pytest.warns(UserWarning, match="trained on base '/models/MiniLM-L6', and the base given is 'bert-base'"):
        assert len(check_base(other, info)) == 1
    assert check_base(plain, {**info, "base_quantization": "none"}) == []
