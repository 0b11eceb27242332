"""``model.seqcls.pack_len`` on tiny random BERT and RoBERTa LoRA classifiers (sdpa and eager attention): the packed
forward's logits and its LoRA and head gradients equal those of the same model without packing (a deep copy, plain
autograd on the padded batch); a batch that is not right-padded, or has an empty
record, is forwarded as it is."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
import transformers

from fs_fedpa.plugin.sequence_packing import SequencePacking

LENGTHS = [7, 2, 5, 9, 3, 3, 8, 1]


def _model(kind: str, attention: str):
    torch.manual_seed(0)
    shapes = dict(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  num_labels=3)  # fmt: skip
    if kind == "bert":
        config = transformers.BertConfig(**shapes)
        model = transformers.BertForSequenceClassification(config)
    else:
        config = transformers.RobertaConfig(**shapes, pad_token_id=1)
        model = transformers.RobertaForSequenceClassification(config)
    model.config._attn_implementation = attention
    for m in model.modules():
        if getattr(m, "config", None) is not None:
            m.config._attn_implementation = attention
    lora = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=2, lora_alpha=4, target_modules=["query", "value"])
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():  # B starts at 0: give it values so that every gradient is nonzero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


def _batch(pad: int, left: bool = False):
    torch.manual_seed(1)
    L = max(LENGTHS) + 2
    mask = (torch.arange(L) < torch.tensor(LENGTHS)[:, None]).long()
    if left:
        mask = mask.flip(1)
    ids = torch.where(mask.bool(), torch.randint(3, 60, mask.shape), pad)
    types = torch.where(mask.bool(), torch.randint(0, 2, mask.shape), 0)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}, torch.randint(0, 3, (len(LENGTHS),))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("budget", [9, 16, 40], ids=["rows_of_9", "rows_of_16", "one_row"])
def test_a_packed_forward_gives_the_padded_logits_and_gradients(kind, attention, budget):
    plain = _model(kind, attention)
    packed = copy.deepcopy(plain)
    packing = SequencePacking(packed, budget)
    features, labels = _batch(plain.config.pad_token_id)
    if kind == "roberta":
        features.pop("token_type_ids")
    grads = {}
    for name, model in (("plain", plain), ("packed", packed)):
        model.train()  # dropout is 0: train mode exercises the same graph as a training step
        logits = model(**features).logits
        loss = torch.nn.functional.cross_entropy(logits, labels)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        found = torch.autograd.grad(loss, [p for _, p in named])
        grads[name] = (logits.detach(), {n: g for (n, _), g in zip(named, found)})
    assert packing.packed == 1 and packing.plain == 0
    torch.testing.assert_close(grads["packed"][0], grads["plain"][0], rtol=1e-5, atol=1e-6)
    assert grads["plain"][1].keys() == grads["packed"][1].keys()
    assert any("lora_A" in n for n in grads["plain"][1]) and any("classifier" in n for n in grads["plain"][1])
    for n, g in grads["plain"][1].items():
        assert g.abs().sum() > 0, n
        torch.testing.assert_close(grads["packed"][1][n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("case", ["left_padded", "empty_record"])
def test_a_batch_packing_cannot_serve_is_forwarded_as_it_is(case):
    plain = _model("bert", "sdpa")
    packed = copy.deepcopy(plain)
    packing = SequencePacking(packed, 16)
    features, _ = _batch(0, left=case == "left_padded")
    if case == "empty_record":
        features["attention_mask"][2] = 0
    plain.eval()
    packed.eval()
    with torch.no_grad():
        torch.testing.assert_close(packed(**features).logits, plain(**features).logits, rtol=0, atol=0)
    assert packing.plain == 1 and packing.packed == 0


def test_a_model_without_a_bert_style_encoder_is_refused():
    with pytest.raises(ValueError, match="BERT-style encoder"):
        SequencePacking(torch.nn.Linear(2, 2), 16)
