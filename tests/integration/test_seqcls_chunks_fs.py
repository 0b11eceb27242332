"""``model.seqcls.train_chunk``: the plain training step forwarded in length-sorted chunks is the step of the whole
batch's mean loss, against autograd on one padded forward of the batch computed here, with a later forward hook's
term (as the alignment term's) still added; its reported loss is the batch's; DP-SGD refuses it.
``model.seqcls.eval_chunk``: an evaluation in length-sorted chunks gives each record the logits of one padded forward
of the whole batch, in the loader's order (so the per-example outcomes), and the same loss. Bad or conflicting
values of these and of ``model.seqcls.pack_len`` are refused naming the key."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.integration.test_dp_sgd_fs import _seqcls

pytestmark = pytest.mark.integration


def _varied(loader):
    """The loader's records, right-padded to 3 + j % 6 tokens (the tiny sentences are of one length), batches of 6."""
    from torch.utils.data import DataLoader

    records = []
    for j, (features, label) in enumerate(loader.dataset):
        features = {k: v.clone() for k, v in features.items()}
        features["attention_mask"][3 + j % 6 :] = 0
        features["input_ids"][3 + j % 6 :] = 0
        records.append((features, label))
    return DataLoader(records, batch_size=6)


def _step(tiny_glue, chunk: int, penalty: bool):
    """One SGD step (lr 1) of the seqcls trainer from the same weights on the loader's first batch of 6 records."""
    from federatedscope.core.monitors.monitor import Monitor
    from federatedscope.core.trainers.context import CtxVar
    from federatedscope.core.trainers.enums import LIFECYCLE

    cfg, trainer_class, model, loader = _seqcls(tiny_glue)
    loader = _varied(loader)
    cfg.merge_from_list(["train.optimizer.type", "SGD", "train.optimizer.lr", 1.0, "train.local_update_steps", 1,
                         "train.batch_or_epoch", "batch", "use_gpu", False,
                         "model.seqcls.train_chunk", chunk])  # fmt: skip
    start = copy.deepcopy(model)
    trainer = trainer_class(model, {"train": loader}, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg))
    if penalty:  # a term added after the task loss, as FedPA's alignment hook adds lam/2 ||.||^2

        def _hook(ctx):
            term = sum(0.5 * p.pow(2).sum() for n, p in ctx.model.named_parameters() if "lora_B" in n)
            ctx.loss_task = CtxVar(ctx.loss_task + term, LIFECYCLE.BATCH)

        trainer.register_hook_in_train(new_hook=_hook, trigger="on_batch_forward")
    _, _, results = trainer.train()
    return start, model, next(iter(loader)), results


@pytest.mark.parametrize("chunk", [1, 4], ids=["records", "chunks_4_2"])
@pytest.mark.parametrize("penalty", [False, True], ids=["task", "task_and_penalty"])
def test_a_chunked_step_is_the_step_of_the_batchs_mean_loss(tiny_glue, chunk, penalty):
    start, model, (features, labels), results = _step(tiny_glue, chunk, penalty)
    lengths = features["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) > 2  # records of several lengths: the chunks are sorted, the batch padded
    # independent: autograd of the mean cross-entropy of one padded forward of all 6 records (plus the penalty)
    reference = copy.deepcopy(start)
    reference.train()
    loss = torch.nn.functional.cross_entropy(reference(**features).logits, labels)
    named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named])
    after = dict(model.named_parameters())
    for (n, p), g in zip(named, grads):
        expected = g + (p.detach() if penalty and "lora_B" in n else 0)
        torch.testing.assert_close(p.detach() - after[n].detach(), expected, rtol=1e-4, atol=1e-6, msg=n)
    assert results["train_loss"] == pytest.approx(float(loss) * len(labels), rel=1e-5)  # FS sums loss x batch size


def test_a_chunked_run_reports_and_takes_what_one_forward_does(tiny_glue):
    runs = {chunk: _step(tiny_glue, chunk, True) for chunk in (0, 4)}
    (_, one, _, plain), (_, chunked, _, split) = runs[0], runs[4]
    assert split["train_loss"] == pytest.approx(plain["train_loss"], rel=1e-5)
    assert split["train_total"] == plain["train_total"] == 6
    for (n, p), q in zip(one.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("chunk", [1, 4], ids=["records", "chunks_4_2"])
def test_a_chunked_evaluation_gives_each_record_its_logits_in_order(tiny_glue, chunk):
    cfg, trainer_class, model, loader = _seqcls(tiny_glue)
    loader = _varied(loader)
    cfg.merge_from_list(["use_gpu", False, "model.seqcls.eval_chunk", chunk, "eval.metrics", ["acc", "loss"],
                         "dataloader.batch_size", 6])  # FS counts the batches from it
    model.eval()
    with torch.no_grad():  # independent: one padded forward of each whole batch
        logits = torch.cat([model(**features).logits for features, _ in loader])
    labels = torch.cat([y for _, y in loader])
    assert len(set(torch.cat([f["attention_mask"].sum(1) for f, _ in loader]).tolist())) > 2
    assert_evaluates_to(trainer_class, model, loader, cfg, logits, labels)


def assert_evaluates_to(trainer_class, model, loader, cfg, logits, labels) -> None:
    """An FS evaluation of ``model`` on ``loader``'s ``val`` split collects ``logits`` in the loader's order, and its
    per-example outcomes and summed loss are theirs."""
    from federatedscope.core.monitors.monitor import Monitor

    class Seen(trainer_class):  # the logits FS collected, in its order, before it clears them
        def _hook_on_fit_end(self, ctx):
            super()._hook_on_fit_end(ctx)
            self.seen = torch.as_tensor(np.asarray(ctx.ys_prob))

    trainer = Seen(model, {"val": loader}, "cpu", cfg, only_for_eval=True, monitor=Monitor(cfg))
    metrics = trainer.evaluate("val")
    torch.testing.assert_close(trainer.seen, logits, rtol=1e-4, atol=1e-5)
    assert (trainer.outcomes["val"] == (logits.argmax(1) == labels).numpy()).all()
    loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    assert metrics["val_loss"] == pytest.approx(float(loss), rel=1e-5)


SEQCLS = ["model.type", "tiny@seqcls_llm"]  # packing is the encoder's: refused on any other model


@pytest.mark.parametrize("opts,why", [
    (["model.seqcls.train_chunk", -1], "must be 0"),
    (["model.seqcls.eval_chunk", -3], "must be 0"),
    (["model.seqcls.train_chunk", 32, "fedpa.dp.mode", "sample", "fedpa.dp.clip", 1.0,
      "fedpa.dp.noise_multiplier", 1.0], "DP-SGD forwards its batches in chunks"),
    (["model.seqcls.pack_len", -1], r"pack_len\(=-1\) must be 0"),
    ([*SEQCLS, "model.seqcls.pack_len", 64, "model.seqcls.train_chunk", 8], "pack_len with model.seqcls.train_chunk"),
    ([*SEQCLS, "model.seqcls.pack_len", 64, "model.seqcls.eval_chunk", 8], "pack_len with model.seqcls.eval_chunk"),
    ([*SEQCLS, "model.seqcls.pack_len", 64, "fedpa.dp.mode", "sample", "fedpa.dp.clip", 1.0,
      "fedpa.dp.noise_multiplier", 1.0], "per-example gradients need one record a row"),
    (["model.seqcls.pack_len", 64], "packs the records of a '@seqcls_llm' encoder only"),  # FS's default model: lr
])  # fmt: skip
def test_a_bad_chunk_or_pack_value_is_refused_naming_it(opts, why):
    from federatedscope.core.configs.config import global_cfg

    cfg = global_cfg.clone()
    with pytest.raises(ValueError, match=why):
        cfg.merge_from_list(opts)
        cfg.freeze()
