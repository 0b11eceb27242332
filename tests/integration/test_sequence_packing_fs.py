"""``model.seqcls.pack_len`` through FS: the plugin's model builder installs the packing, one SGD step of the seqcls
trainer on records of several lengths is autograd's step on one padded forward of an unpacked copy, an evaluation
gives the unpacked model's logits (its bad or conflicting values are refused in test_seqcls_chunks_fs.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.integration.test_dp_sgd_fs import _no_dropout, _spread
from tests.integration.test_seqcls_chunks_fs import _varied, assert_evaluates_to

pytestmark = pytest.mark.integration


def _models(tiny_glue, pack_len: int):
    """``(cfg, trainer class, packed model, unpacked copy, loader of records of 3 to 8 tokens)``."""
    from federatedscope.core.configs.config import global_cfg
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from fs_fedpa.plugin.seqcls import _encode, _trainer_class, build_seqcls_model
    from fs_fedpa.plugin.sequence_packing import SequencePacking
    from fs_fedpa.tasks.glue import get_task, load_glue

    cfg = global_cfg.clone()
    cfg.merge_from_list(["model.type", f"{tiny_glue['model']}@seqcls_llm", "model.seqcls.num_labels", 2,
                         "model.seqcls.lora_dropout", 0.0, "model.seqcls.pack_len", pack_len, "trainer.type",
                         "seqcls", "criterion.type", "CrossEntropyLoss", "use_gpu", False])  # fmt: skip
    torch.manual_seed(0)
    model = _spread(_no_dropout(build_seqcls_model(cfg.model)))
    hooks = [h for m in model.modules() for h in m._forward_pre_hooks.values()]
    assert any(isinstance(getattr(h, "__self__", None), SequencePacking) for h in hooks)  # the builder installed it
    plain = copy.deepcopy(model)
    for m in plain.modules():  # the copy without the packing hooks
        m._forward_pre_hooks.clear()
        m._forward_hooks.clear()
    tokenizer = AutoTokenizer.from_pretrained(tiny_glue["model"])
    examples = _encode(load_glue(get_task("sst2"), tiny_glue["glue"], "train", limit=40), tokenizer, 32)
    return cfg, _trainer_class(), model, plain, _varied(DataLoader(examples, batch_size=6))


def test_a_packed_step_is_the_step_of_one_padded_forward(tiny_glue):
    from federatedscope.core.monitors.monitor import Monitor

    cfg, trainer_class, model, plain, loader = _models(tiny_glue, 10)
    features, labels = next(iter(loader))
    assert len(set(features["attention_mask"].sum(1).tolist())) > 2
    cfg.merge_from_list(["train.optimizer.type", "SGD", "train.optimizer.lr", 1.0, "train.local_update_steps", 1,
                         "train.batch_or_epoch", "batch"])  # fmt: skip
    plain.train()
    loss = torch.nn.functional.cross_entropy(plain(**features).logits, labels)
    named = [(n, p) for n, p in plain.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named])
    trainer = trainer_class(model, {"train": loader}, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg))
    _, _, results = trainer.train()
    after = dict(model.named_parameters())
    for (n, p), g in zip(named, grads):
        torch.testing.assert_close(p.detach() - after[n].detach(), g, rtol=1e-4, atol=1e-6, msg=n)
    assert results["train_loss"] == pytest.approx(float(loss) * len(labels), rel=1e-5)


def test_a_packed_evaluation_gives_the_unpacked_logits(tiny_glue):
    cfg, trainer_class, model, plain, loader = _models(tiny_glue, 10)
    cfg.merge_from_list(["eval.metrics", ["acc", "loss"], "dataloader.batch_size", 6])
    plain.eval()
    with torch.no_grad():
        logits = torch.cat([plain(**features).logits for features, _ in loader])
    labels = torch.cat([y for _, y in loader])
    assert_evaluates_to(trainer_class, model, loader, cfg, logits, labels)
