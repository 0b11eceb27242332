"""DP-SGD's hooks in FS's own GeneralTorchTrainer, against per-example gradients from torch.func on a linear model
(an independent computation), for the records the DP generator draws, with the per-example gradients from the
batched taps and from the per-example loop; and the two against each other on LoRA models (a BERT classifier in the
plugin's seqcls trainer, a Llama in FS-LLM's own trainer)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.integration

N, B = 10, 4


def _trainer(lr: float = 1.0, extra_hook=None, zero_data: bool = False, n: int = N):
    from federatedscope.core.configs.config import global_cfg
    from federatedscope.core.monitors.monitor import Monitor
    from federatedscope.core.trainers import GeneralTorchTrainer

    cfg = global_cfg.clone()
    cfg.merge_from_list(["train.optimizer.type", "SGD", "train.optimizer.lr", lr, "train.local_update_steps", 1,
                         "train.batch_or_epoch", "batch", "dataloader.batch_size", B, "criterion.type", "MSELoss",
                         "use_gpu", False])  # fmt: skip
    torch.manual_seed(0)
    X, y = torch.randn(n, 3), torch.randn(n, 1)
    model = torch.nn.Linear(3, 1)
    if zero_data:  # every per-example gradient is 0: a step is its noise alone
        X, y = X * 0, y * 0
        torch.nn.init.zeros_(model.bias)
    data = {"train": DataLoader(TensorDataset(X, y), batch_size=B, shuffle=True)}
    trainer = GeneralTorchTrainer(model, data, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg))
    if extra_hook is not None:
        trainer.register_hook_in_train(new_hook=extra_hook, trigger="on_batch_forward")
    return trainer, model, X, y


def _dp_step(trainer, clip: float, z: float = 0.0, seed: int = 3, batched: bool = True, b: int = B, chunk=None,
             sampling: str = "wor", steps: int = 1):  # fmt: skip
    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.privacy.mechanism import dp_generator
    from fs_fedpa.privacy.sample_level import SamplePlan

    dp = DPSGD(trainer, lambda n: SamplePlan(n, b, steps, z, 1e-5, sampling), lambda routine: dp_generator(seed, "t"),
               clip=clip, batched=batched, chunk=chunk)  # fmt: skip
    trainer.train()
    assert dp.batched == batched  # the taps served every batch, or were not asked to
    return dp


def _per_example_grads(weight, bias, X, y):
    """(n, 1, 3) and (n, 1): the gradient of (w x + b - y)^2 per record, by torch.func.vmap."""
    from torch.func import grad, vmap

    def loss(w, b, x, t):
        return ((x @ w.T + b - t) ** 2).mean()

    return vmap(grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0))(weight, bias, X, y)


def _chosen(seed: int = 3) -> list[int]:
    from fs_fedpa.privacy.mechanism import dp_generator, sample_without_replacement

    return sample_without_replacement(N, B, dp_generator(seed, "t"))


@pytest.mark.parametrize("batched", [True, False], ids=["taps", "loop"])
@pytest.mark.parametrize("clip", [1e9, 0.3])
def test_step_is_the_mean_of_clipped_per_example_gradients(clip, batched):
    trainer, model, X, y = _trainer()
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    _dp_step(trainer, clip, batched=batched)
    idx = _chosen()
    gw, gb = _per_example_grads(w0, b0, X[idx], y[idx])
    norms = (gw.flatten(1).pow(2).sum(1) + gb.flatten(1).pow(2).sum(1)).sqrt()
    c = torch.clamp(clip / norms, max=1.0)
    assert (c < 1).any() == (clip < 1)  # the small clip bites, the large one does not
    expected_w = w0 - (c[:, None, None] * gw).sum(0) / B
    expected_b = b0 - (c[:, None] * gb).sum(0) / B
    torch.testing.assert_close(model.weight.detach(), expected_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.bias.detach(), expected_b, rtol=1e-5, atol=1e-6)


def test_the_rounds_signal_and_noise_norms_are_those_of_its_clipped_sum_and_its_noise():
    """The local diagnostic (DPSGD.signal_noise): without noise, ||sum of clipped per-example gradients|| by vmap;
    on zero data, ||noise|| = ||the step|| x b / lr, read off the parameters' change."""
    trainer, model, X, y = _trainer()
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    dp = _dp_step(trainer, 0.3)
    gw, gb = _per_example_grads(w0, b0, X[_chosen()], y[_chosen()])
    c = torch.clamp(0.3 / (gw.flatten(1).pow(2).sum(1) + gb.flatten(1).pow(2).sum(1)).sqrt(), max=1.0)
    clipped = torch.cat([(c[:, None, None] * gw).sum(0).flatten(), (c[:, None] * gb).sum(0).flatten()])
    signal, noise = dp.signal_noise()
    assert signal == pytest.approx(float(clipped.norm()), rel=1e-5) and noise == 0.0

    trainer, model, X, y = _trainer(zero_data=True)
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    dp = _dp_step(trainer, 1.0, z=2.0)
    step = torch.cat([(model.weight.detach() - w0).flatten(), (model.bias.detach() - b0).flatten()])
    signal, noise = dp.signal_noise()
    assert signal == 0.0 and noise == pytest.approx(float(step.norm()) * B / 1.0, rel=1e-5)  # lr 1
    dp.new_round()
    assert dp.signal_noise() is None


def _poisson_drawn(seed: int, rate: float) -> list[int]:
    """The records a Poisson draw at ``rate`` takes from the DP generator's stream, by hand: one uniform a record."""
    from fs_fedpa.privacy.mechanism import dp_generator

    u = torch.rand(N, generator=dp_generator(seed, "t"), dtype=torch.float64)
    return [j for j in range(N) if u[j] < rate]


@pytest.mark.parametrize("batched", [True, False], ids=["taps", "loop"])
def test_a_poisson_step_sums_the_drawn_records_and_divides_by_the_expected_b(batched):
    trainer, model, X, y = _trainer()
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    seed = next(s for s in range(50) if len(_poisson_drawn(s, B / N)) not in (0, B))  # dividing by it would differ
    idx = _poisson_drawn(seed, B / N)
    _dp_step(trainer, 0.3, seed=seed, batched=batched, sampling="poisson")
    gw, gb = _per_example_grads(w0, b0, X[idx], y[idx])
    c = torch.clamp(0.3 / (gw.flatten(1).pow(2).sum(1) + gb.flatten(1).pow(2).sum(1)).sqrt(), max=1.0)
    torch.testing.assert_close(model.weight.detach(), w0 - (c[:, None, None] * gw).sum(0) / B, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.bias.detach(), b0 - (c[:, None] * gb).sum(0) / B, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [16, 256], ids=["chunks_of_16", "one_forward"])
def test_a_logical_batch_of_256_over_chunks_is_one_step_of_its_256_records(chunk):
    """b = 256 records a DP step whatever the physical chunk: 16 forwards of 16 records, each clipped and summed as
    it comes, take the same step as one forward of 256, and both the step of the records drawn, by torch.func."""
    from fs_fedpa.privacy.mechanism import dp_generator, sample_without_replacement

    trainer, model, X, y = _trainer(lr=0.5, n=300)
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    _dp_step(trainer, 0.5, b=256, chunk=chunk)
    idx = sample_without_replacement(300, 256, dp_generator(3, "t"))
    gw, gb = _per_example_grads(w0, b0, X[idx], y[idx])
    c = torch.clamp(0.5 / (gw.flatten(1).pow(2).sum(1) + gb.flatten(1).pow(2).sum(1)).sqrt(), max=1.0)
    assert (c < 1).any() and (c == 1).any()
    torch.testing.assert_close(model.weight.detach(), w0 - 0.5 * (c[:, None, None] * gw).sum(0) / 256, rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    torch.testing.assert_close(model.bias.detach(), b0 - 0.5 * (c[:, None] * gb).sum(0) / 256, rtol=1e-5, atol=1e-6)


def test_an_empty_poisson_draw_is_a_step_of_noise_alone():
    seed = next(s for s in range(200) if not _poisson_drawn(s, 1 / N))  # b = 1: about a third of the draws are empty
    trainer, model, X, y = _trainer()
    w0 = model.weight.detach().clone()
    dp = _dp_step(trainer, 1.0, z=0.0, seed=seed, b=1, sampling="poisson")
    assert dp.round_steps == 1 and dp.round_empty == 1
    torch.testing.assert_close(model.weight.detach(), w0)  # no record, no noise (z = 0): no move
    trainer, model, X, y = _trainer()
    _dp_step(trainer, 1.0, z=2.0, seed=seed, b=1, sampling="poisson")
    assert not torch.equal(model.weight.detach(), w0)  # the noise alone moves it


@pytest.mark.parametrize("batched", [True, False], ids=["taps", "loop"])
def test_data_free_term_is_added_after_clipping(batched):
    from federatedscope.core.trainers.context import CtxVar
    from federatedscope.core.trainers.enums import LIFECYCLE

    lam = 0.7

    def alignment(ctx):  # like FedPA's alignment hook: a term that reads no record
        ctx.loss_task = CtxVar(ctx.loss_task + 0.5 * lam * ctx.model.weight.pow(2).sum(), LIFECYCLE.BATCH)

    trainer, model, X, y = _trainer(extra_hook=alignment)
    w0 = model.weight.detach().clone()
    _dp_step(trainer, clip=1e-12, batched=batched)
    # the task part is clipped to nothing; the term's gradient lam w arrives whole
    torch.testing.assert_close(model.weight.detach(), w0 - lam * w0, rtol=1e-6, atol=1e-9)


def test_noise_is_z_C_over_b_per_entry():
    steps = []
    for seed in range(150):
        trainer, model, X, y = _trainer(zero_data=True)
        w0 = model.weight.detach().clone()
        _dp_step(trainer, clip=1.0, z=2.0, seed=seed)
        steps.append(model.weight.detach() - w0)
    spread = float(torch.cat(steps).flatten().std())
    assert abs(spread - 2.0 * 1.0 / B) < 0.12 * 2.0 / B  # 450 draws: the std's standard error is about 3.3 %


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for m in model.modules():  # attention implementations read the probability from the config
        config = getattr(m, "config", None)
        for key in ("attention_dropout", "attention_probs_dropout_prob", "hidden_dropout_prob"):
            if config is not None and hasattr(config, key):
                setattr(config, key, 0.0)
    return model


def _spread(model):
    """PEFT starts B at 0 and a new head near 0: give both values, so that A's gradients are not 0 and the records'
    gradients differ (with a head near 0, the two labels' gradients cancel in the sum)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and "lora_A" not in name:
                p.normal_(0, 0.5)
    return model


def _seqcls(tiny_glue):
    """The plugin's seqcls trainer's class and a LoRA BERT classifier (r = 4, head trained) with its loader."""
    from federatedscope.core.configs.config import global_cfg
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from fs_fedpa.plugin.seqcls import _encode, _trainer_class, build_seqcls_model
    from fs_fedpa.tasks.glue import get_task, load_glue

    cfg = global_cfg.clone()
    cfg.merge_from_list(["model.type", f"{tiny_glue['model']}@seqcls_llm", "model.seqcls.num_labels", 2,
                         "model.seqcls.lora_dropout", 0.0, "trainer.type", "seqcls", "criterion.type",
                         "CrossEntropyLoss"])  # fmt: skip
    torch.manual_seed(0)
    model = _no_dropout(build_seqcls_model(cfg.model))
    _spread(model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_glue["model"])
    examples = _encode(load_glue(get_task("sst2"), tiny_glue["glue"], "train", limit=40), tokenizer, 32)
    return cfg, _trainer_class(), model, DataLoader(examples, batch_size=6)


def _causal(tiny_llm):
    """FS-LLM's trainer's class and a LoRA Llama (r = 4 on q and v) with a loader of right-padded records of 5 to 12
    tokens, the first 3 of each and the padding labelled -100, and one record with no label token at all."""
    import peft
    from federatedscope.core.configs.config import global_cfg
    from federatedscope.llm.trainer.trainer import LLMTrainer
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    cfg = global_cfg.clone()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_llm["model"])
    lora = peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=4, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj"])  # fmt: skip
    model = _spread(_no_dropout(peft.get_peft_model(base, lora)))
    records, vocab = [], base.config.vocab_size
    for j in range(20):
        n = 5 + j % 8
        ids = torch.full((12,), 0)
        ids[:n] = torch.randint(4, vocab, (n,))
        labels = ids.clone()
        labels[:3] = -100
        labels[n:] = -100
        if j == 5:  # among the records seed 3 draws
            labels[:] = -100
        records.append({"input_ids": ids, "labels": labels, "attention_mask": (torch.arange(12) < n).long()})
    return cfg, LLMTrainer, model, DataLoader(records, batch_size=6)


@pytest.mark.parametrize("chunk", [None, 1, 6], ids=["cpu_chunks", "chunk1", "whole"])
@pytest.mark.parametrize("kind", ["seqcls", "causal"])
def test_taps_and_loop_take_the_same_step_on_lora_models(kind, chunk, tiny_glue, tiny_llm):
    """One DP-SGD step (SGD, lr 1, no noise, a clip that bites) from the same weights on the same drawn records:
    the batched taps (in the CPU's chunks of 4 length-sorted records, 4 + 2 here; one record a forward; the whole
    batch) and the per-example loop move every trainable tensor alike."""
    from federatedscope.core.monitors.monitor import Monitor

    cfg, trainer_class, model, loader = _seqcls(tiny_glue) if kind == "seqcls" else _causal(tiny_llm)
    cfg.merge_from_list(["train.optimizer.type", "SGD", "train.optimizer.lr", 1.0, "train.local_update_steps", 1,
                         "train.batch_or_epoch", "batch", "use_gpu", False])  # fmt: skip
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    after, moved = {}, {}
    for batched in (True, False):
        m = copy.deepcopy(model)
        trainer = trainer_class(m, {"train": loader}, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg))
        _dp_step(trainer, clip=0.05, batched=batched, b=6, chunk=chunk)
        after[batched] = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
        moved[batched] = sum(float((after[batched][n] - start[n]).pow(2).sum()) for n in start) ** 0.5
    assert 1e-3 < moved[False] <= 0.05 * 1.0001  # a mean of 6 gradients clipped to norm C
    if kind == "causal":
        assert {n.split(".")[-3] for n in start} == {"lora_A", "lora_B"}
    for n in start:
        torch.testing.assert_close(after[True][n] - start[n], after[False][n] - start[n], rtol=1e-3, atol=1e-7, msg=n)


def test_a_clients_delta_above_its_bound_is_refused_when_it_is_built_not_in_its_first_batch():
    """n_i = 20,000 records: the per-client bound is min(1e-5, 1/(10 n_i)) = 5e-6, so fedpa.dp.delta 1e-5 must stop
    the client as it is set up (before, the plan, and with it the check, was first made inside the first batch)."""
    from types import SimpleNamespace

    from federatedscope.core.configs.config import global_cfg
    from federatedscope.core.monitors.monitor import Monitor
    from federatedscope.core.trainers import GeneralTorchTrainer

    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.privacy import client_policy

    cfg = global_cfg.clone()
    cfg.merge_from_list(["train.local_update_steps", 1, "train.batch_or_epoch", "batch", "dataloader.batch_size", 4,
                         "criterion.type", "MSELoss", "use_gpu", False, "fedpa.dp.mode", "sample",
                         "fedpa.dp.clip", 1.0, "fedpa.dp.noise_multiplier", 1.0, "fedpa.dp.delta", 1e-5])  # fmt: skip
    data = {"train": DataLoader(TensorDataset(torch.zeros(20000, 3), torch.zeros(20000, 1)), batch_size=4)}
    trainer = GeneralTorchTrainer(torch.nn.Linear(3, 1), data, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg))
    assert trainer.ctx.num_train_data == 20000
    fedpa = FedPAConfig(dp={"mode": "sample", "clip": 1.0, "noise_multiplier": 1.0, "delta": 1e-5})
    method = SimpleNamespace(cfg=fedpa, personal_weight=None)
    with pytest.raises(ValueError, match=r"above min\(1e-5, 1/\(10 x 20000 n_i records\)\)"):
        client_policy(cfg, method, trainer, [], DPSGD)


@pytest.mark.parametrize("dp_chunk,expected", [(0, None), (32, 32)])
def test_fedpa_dp_chunk_sets_the_records_a_dp_sgd_forward_takes(dp_chunk, expected):
    """fedpa.dp.chunk reaches the client's DP-SGD (0: its device's default); under no DP it is refused as stray."""
    from types import SimpleNamespace

    from federatedscope.core.configs.config import global_cfg
    from federatedscope.core.monitors.monitor import Monitor
    from federatedscope.core.trainers import GeneralTorchTrainer

    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.privacy import client_policy

    cfg = global_cfg.clone()
    cfg.merge_from_list(["train.local_update_steps", 1, "train.batch_or_epoch", "batch", "dataloader.batch_size", 4,
                         "criterion.type", "MSELoss", "use_gpu", False, "fedpa.dp.mode", "sample", "fedpa.dp.clip",
                         1.0, "fedpa.dp.noise_multiplier", 1.0])  # fmt: skip
    data = {"train": DataLoader(TensorDataset(torch.zeros(64, 3), torch.zeros(64, 1)), batch_size=4)}
    trainer = GeneralTorchTrainer(torch.nn.Linear(3, 1), data, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg))
    fedpa = FedPAConfig(dp={"mode": "sample", "clip": 1.0, "noise_multiplier": 1.0, "chunk": dp_chunk})
    privacy = client_policy(cfg, SimpleNamespace(cfg=fedpa, personal_weight=None), trainer, [], DPSGD)
    assert privacy.dp_sgd.chunk == expected
    with pytest.raises(ValueError, match="fedpa.dp.chunk=32 set while fedpa.dp.mode is .none."):
        FedPAConfig(dp={"chunk": 32})  # no DP: a DP-only key set is refused
    with pytest.raises(ValueError, match="fedpa.dp.chunk is a choice of DP-SGD"):
        FedPAConfig(dp={"mode": "client", "clip": 1.0, "noise_multiplier": 1.0, "chunk": 32})
    with pytest.raises(ValueError, match=r"fedpa.dp.chunk\(=-1\)"):
        FedPAConfig(dp={"mode": "sample", "clip": 1.0, "noise_multiplier": 1.0, "chunk": -1})


@pytest.mark.parametrize("kind", ["cosine", "constant"])
def test_the_run_schedule_sets_each_steps_rate_from_the_global_step(kind):
    """Round 3 of a 5-round run of 4 steps a round, 6 steps of warm-up: the k-th step of the round runs at
    lr x factor(3 * 4 + k), computed here from the closed form."""
    import math

    from federatedscope.core.configs.config import global_cfg

    from fs_fedpa.plugin.schedule import RunSchedule

    cfg = global_cfg.clone()
    cfg.merge_from_list(["train.optimizer.type", "SGD", "train.optimizer.lr", 0.2, "train.local_update_steps", 4,
                         "train.batch_or_epoch", "batch", "dataloader.batch_size", B, "criterion.type", "MSELoss",
                         "federate.total_round_num", 5, "fedpa.lr_schedule", kind, "fedpa.lr_warmup_steps", 6,
                         "use_gpu", False])  # fmt: skip
    seen = []
    trainer, model, X, y = _trainer(extra_hook=lambda ctx: seen.append(ctx.optimizer.param_groups[0]["lr"]))
    trainer.cfg.merge_from_other_cfg(cfg)
    schedule = RunSchedule(trainer, cfg)
    schedule.new_round(3)
    trainer.train()
    total = 5 * 4
    for k, lr in enumerate(seen):
        step = 3 * 4 + k
        factor = 1.0 if kind == "constant" else (1 + math.cos(math.pi * (step - 6) / (total - 6))) / 2
        assert lr == pytest.approx(0.2 * factor)
    assert len(seen) == 4


def test_dp_sgd_steps_through_sgd_with_momentum():
    """Two DP-SGD steps (z = 0) through FS's SGD with momentum 0.9: torch's buffer v = 0.9 v + g, then w -= lr v,
    each g the clipped mean of the step's drawn records, by torch.func at the step's weights."""
    from fs_fedpa.privacy.mechanism import dp_generator, sample_without_replacement

    trainer, model, X, y = _trainer(lr=0.1)
    trainer.cfg.train.optimizer.momentum = 0.9  # FS passes the optimizer node's keys to torch.optim.SGD
    trainer.cfg.merge_from_list(["train.local_update_steps", 2])
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    generator, draws = dp_generator(3, "t"), []
    for _ in range(2):  # each step draws its records, then its noise (z = 0 scales it away, but it is drawn)
        draws.append(sample_without_replacement(N, B, generator))
        torch.randn((1, 3), generator=generator, dtype=torch.float64)
        torch.randn((1,), generator=generator, dtype=torch.float64)
    _dp_step(trainer, 0.3, steps=2)
    vw = vb = None
    for idx in draws:
        gw, gb = _per_example_grads(w, b, X[idx], y[idx])
        c = torch.clamp(0.3 / (gw.flatten(1).pow(2).sum(1) + gb.flatten(1).pow(2).sum(1)).sqrt(), max=1.0)
        mw, mb = (c[:, None, None] * gw).sum(0) / B, (c[:, None] * gb).sum(0) / B
        vw, vb = (mw, mb) if vw is None else (0.9 * vw + mw, 0.9 * vb + mb)
        w, b = w - 0.1 * vw, b - 0.1 * vb
    torch.testing.assert_close(model.weight.detach(), w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.bias.detach(), b, rtol=1e-5, atol=1e-6)


def test_the_run_schedule_is_refused_beside_fs_scheduler_and_warmup_needs_a_schedule():
    from federatedscope.core.configs.config import global_cfg

    from fs_fedpa.config import FedPAConfig

    cfg = global_cfg.clone()
    with pytest.raises(ValueError, match="both set the learning rate of every step"):
        cfg.merge_from_list(["federate.method", "fedpa", "fedpa.lr_schedule", "cosine", "train.scheduler.type",
                             "StepLR"])  # fmt: skip
    with pytest.raises(ValueError, match="needs fedpa.lr_schedule"):
        FedPAConfig(lr_warmup_steps=10)


def test_a_dp_sgd_run_through_fs_follows_the_run_schedule(tiny_llm, tmp_path):
    """The client installs the schedule: a 2-round DP-SGD run with a cosine schedule completes and says so."""
    from tests.integration.conftest import fedpa_cfg
    from tests.integration.tiny_assets import outdir_of, run_fs

    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"federate.total_round_num": 2, "fedpa.dp.mode": "sample",
                                           "fedpa.dp.clip": 1.0, "fedpa.dp.noise_multiplier": 1.0,
                                           "fedpa.lr_schedule": "cosine", "fedpa.lr_warmup_steps": 2})  # fmt: skip
    proc = run_fs(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (outdir_of(cfg) / "exp_print.log").read_text()
    assert "learning rate: cosine schedule over 2 rounds of tau steps" in log and "2 steps of warm-up" in log


def test_layers_to_transform_reduces_the_trainable_set_to_the_chosen_layers(tiny_glue):
    """model.seqcls.layers_to_transform [1] on the 2-layer BERT: LoRA only in layer 1, half the LoRA tensors of the
    default (D, the trainable size, is what DP noise is spread over); the head stays trainable."""
    from federatedscope.core.configs.config import global_cfg

    from fs_fedpa.plugin.seqcls import build_seqcls_model

    def trainable(*more):
        cfg = global_cfg.clone()
        cfg.merge_from_list(["model.type", f"{tiny_glue['model']}@seqcls_llm", "model.seqcls.num_labels", 2, *more])
        return {n for n, p in build_seqcls_model(cfg.model).named_parameters() if p.requires_grad}

    every, top = trainable(), trainable("model.seqcls.layers_to_transform", [1])
    lora_every, lora_top = {n for n in every if "lora_" in n}, {n for n in top if "lora_" in n}
    assert lora_top and all(".layer.1." in n for n in lora_top) and len(lora_top) * 2 == len(lora_every)
    assert {n for n in top if "lora_" not in n} == {n for n in every if "lora_" not in n}  # the head
    with pytest.raises(ValueError, match="must be layer indices"):
        global_cfg.clone().merge_from_list(["model.seqcls.layers_to_transform", [-1]])


def _two_layer_trainer(zero_data: bool = False, hidden: int = 2, out: int = 1):
    """FS's trainer on a body (``0``) and a head (``1``), SGD at lr 1, N records of 3 features."""
    from federatedscope.core.configs.config import global_cfg
    from federatedscope.core.monitors.monitor import Monitor
    from federatedscope.core.trainers import GeneralTorchTrainer

    cfg = global_cfg.clone()
    cfg.merge_from_list(["train.optimizer.type", "SGD", "train.optimizer.lr", 1.0, "train.local_update_steps", 1,
                         "train.batch_or_epoch", "batch", "dataloader.batch_size", B, "criterion.type", "MSELoss",
                         "use_gpu", False])  # fmt: skip
    torch.manual_seed(1)
    X, y = torch.randn(N, 3), torch.randn(N, out)
    if zero_data:
        X, y = X * 0, y * 0
    model = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Linear(hidden, out))
    if zero_data:
        for p in model.parameters():
            torch.nn.init.zeros_(p)
    data = {"train": DataLoader(TensorDataset(X, y), batch_size=B, shuffle=True)}
    return GeneralTorchTrainer(model, data, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg)), model, X, y


HEAD = frozenset({"1.weight", "1.bias"})


@pytest.mark.parametrize("batched", [True, False], ids=["taps", "loop"])
@pytest.mark.parametrize("frozen", [frozenset(), HEAD], ids=["head_noised", "head_frozen"])
def test_the_head_is_clipped_and_noised_with_the_body_or_held_still(batched, frozen):
    """fedpa.dp.local_tensors: a noised head is clipped jointly with the body; a frozen head takes no step, and the
    body's records are clipped on the body's norm alone. Expected steps from torch.func's per-example gradients of
    the two-layer model."""
    from torch.func import functional_call, grad, vmap

    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.privacy.mechanism import dp_generator
    from fs_fedpa.privacy.sample_level import SamplePlan

    trainer, model, X, y = _two_layer_trainer()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    DPSGD(trainer, lambda n: SamplePlan(n, B, 1, 0.0, 1e-5), lambda routine: dp_generator(3, "t"), clip=0.05,
          batched=batched, frozen=frozen)  # fmt: skip
    trainer.train()
    idx = _chosen()

    def loss(params, x, t):
        return ((functional_call(model, params, (x[None],)) - t) ** 2).mean()

    per = vmap(grad(loss), in_dims=(None, 0, 0))(before, X[idx], y[idx])
    private = [n for n in before if n not in frozen]
    norms = sum(per[n].flatten(1).pow(2).sum(1) for n in private).sqrt()
    c = torch.clamp(0.05 / norms, max=1.0)
    assert (c < 1).all()  # the clip bites on every record
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p.detach(), before[n]), n
            continue
        expected = before[n] - (c.view(-1, *[1] * (per[n].ndim - 1)) * per[n]).sum(0) / B
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)


def test_a_frozen_head_takes_no_step_under_noise_or_a_regularizer():
    """Zero data, zero weights: every gradient is 0, so a step is its noise alone; the frozen head stays at 0 even
    with FS's L2 regularizer on (its gradient would move it), the body moves."""
    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.privacy.mechanism import dp_generator
    from fs_fedpa.privacy.sample_level import SamplePlan

    trainer, model, X, y = _two_layer_trainer(zero_data=True)
    with torch.no_grad():
        model[1].weight.fill_(1.0)  # a regularizer's gradient on it is not zero
    DPSGD(trainer, lambda n: SamplePlan(n, B, 1, 2.0, 1e-5), lambda routine: dp_generator(3, "t"), clip=1.0,
          frozen=HEAD)  # fmt: skip

    def l2(ctx):  # a data-free term on every tensor, as FS's regularizer adds to ctx.loss_task
        ctx.loss_task = ctx.loss_task + sum((p**2).sum() for p in ctx.model.parameters())

    trainer.register_hook_in_train(new_hook=l2, trigger="on_batch_forward")
    trainer.train()
    params = dict(model.named_parameters())
    assert float(params["1.bias"].abs().max()) == 0.0 and bool((params["1.weight"] == 1.0).all())
    assert float(params["0.weight"].abs().max()) > 0


LEAKS = ("loss_after_noise", "plain_head")


def _neighbour_trainer(canary: int | None, leak: str | None, bias: torch.Tensor | None = None):
    """The two-layer trainer with record ``canary`` replaced by a far-off one (None: the records as they are), a
    data-free term on every tensor (as FedPA-LoRA's alignment and FS's regularizer add after the noise), and
    ``leak``: a data-dependent term the mechanism must not let through, the drawn batch's exact loss added after the
    noise (``loss_after_noise``) or the head on its exact gradient (``plain_head``, the withdrawn 'plain'); ``bias``:
    a fixed logit correction added to the model's output (fedpa.dp.label_prior's hook)."""
    trainer, model, X, y = _two_layer_trainer()
    if bias is not None:
        from fs_fedpa.plugin.logit_bias import add_logit_bias

        add_logit_bias(model, bias)
    if canary is not None:
        X[canary], y[canary] = X[canary] * 10, 50.0  # the dataset is the trainer's tensors: this is its neighbour
    head = [p for n, p in model.named_parameters() if n in HEAD]

    def data_free(ctx):
        ctx.loss_task = ctx.loss_task + 0.05 * sum((p**2).sum() for p in model.parameters())

    def loss_after_noise(ctx):
        inputs, target = ctx.data_batch
        ctx.loss_task = ctx.loss_task + ((model(inputs) - target) ** 2).mean()

    def plain_head(ctx):
        inputs, target = ctx.data_batch
        grads = torch.autograd.grad(((model(inputs) - target) ** 2).mean(), head)
        with torch.no_grad():
            for p, g in zip(head, grads):
                p.sub_(g)

    trainer.register_hook_in_train(new_hook=data_free, trigger="on_batch_forward")
    if leak == "loss_after_noise":
        trainer.register_hook_in_train(new_hook=loss_after_noise, trigger="on_batch_forward")
    elif leak == "plain_head":
        trainer.register_hook_in_train(new_hook=plain_head, trigger="on_batch_end", insert_pos=0)
    return trainer, model


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in model.parameters()])


def _released_steps(frozen: frozenset, sampling: str, batched: bool, leak: str | None = None, steps: int = 3,
                    clip: float = 0.05, z: float = 1.0, local: frozenset = frozenset(), local_clip: float = 0.0,
                    bias: torch.Tensor | None = None, moves_out: list | None = None) -> tuple[list, int]:  # fmt: skip
    """DP-SGD's released steps through FS's trainer and optimizer (SGD at lr 1 on every tensor, noise z): a run of
    ``steps`` steps on the records gives the model and the DP generator's state before each step; from each, one
    step on the records and one on the neighbour (the first record the first step draws replaced), with the same
    generator state, so the same draw and noise. Returns, per step, ||move on the records - move on the neighbour||
    over every tensor of the model, and the seed; with ``local`` (the head as its own clipping group, clipped to
    ``local_clip``), per step the pair (gap over the other tensors, gap over ``local``)."""
    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.privacy.mechanism import dp_generator
    from fs_fedpa.privacy.sample_level import SamplePlan

    seed = 3 if sampling == "wor" else next(s for s in range(50) if _poisson_drawn(s, B / N))
    canary = (_chosen(seed) if sampling == "wor" else _poisson_drawn(seed, B / N))[0]

    def dp(trainer, count: int, state=None):
        def generator(routine):
            g = dp_generator(seed, "t")
            return g if state is None else g.set_state(state)

        groups = 2 if local else 1
        return DPSGD(trainer, lambda n: SamplePlan(n, B, count, z, 1e-5, sampling, groups=groups), generator,
                     clip=clip, batched=batched, frozen=frozen, local=local, local_clip=local_clip)  # fmt: skip

    trainer, model = _neighbour_trainer(None, leak, bias)
    hooks = dp(trainer, steps)
    trainer.cfg.defrost()
    trainer.cfg.train.local_update_steps = steps
    starts = []

    def keep(ctx):  # before DP-SGD's draw
        starts.append((copy.deepcopy(model.state_dict()), hooks.generator.get_state()))

    trainer.register_hook_in_train(new_hook=keep, trigger="on_batch_start", insert_pos=0)
    trainer.train()
    assert len(starts) == steps
    gaps = []
    for weights, state in starts:
        moves = []
        for neighbour in (None, canary):
            trainer, model = _neighbour_trainer(neighbour, leak, bias)
            model.load_state_dict(weights)
            before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
            dp(trainer, 1, state)
            trainer.train()
            moves.append({n: p.detach().double() - before[n] for n, p in model.named_parameters()})

        def gap(names, moves=moves) -> float:
            return float(torch.cat([(moves[0][n] - moves[1][n]).flatten() for n in names]).norm())

        if local:
            gaps.append((gap([n for n in moves[0] if n not in local]), gap(sorted(local))))
        else:
            gaps.append(gap(list(moves[0])))
        if moves_out is not None:
            moves_out.append(moves[0])
    return gaps, seed


@pytest.mark.parametrize("batched", [True, False], ids=["taps", "loop"])
@pytest.mark.parametrize("sampling", ["wor", "poisson"])
@pytest.mark.parametrize("frozen", [frozenset(), HEAD], ids=["head_noised", "head_frozen"])
def test_a_released_step_moves_at_most_lr_2c_over_b_between_neighbours(frozen, sampling, batched):
    """DP-SGD's sensitivity, through the plugin's hooks and FS's own optimizer step on every tensor DP-SGD trains
    (lr 1, noise on): from the same model and generator state, the step on two datasets that differ in one record
    moves the whole model by at most lr 2C / b apart (replace-one; the noise, the same draw, cancels), for each
    treatment of the head, each sampling and both per-example paths. A data-free term added after the noise is
    inside the bound (it is the same on both)."""
    C = 0.05
    gaps, _ = _released_steps(frozen, sampling, batched, clip=C)
    bound = 1.0 * 2 * C / B
    assert gaps[0] > 0.1 * bound, gaps  # the canary is drawn at the first step and moves it
    assert max(gaps) <= bound * (1 + 1e-6) + 1e-9, (gaps, bound)


@pytest.mark.parametrize("batched", [True, False], ids=["taps", "loop"])
@pytest.mark.parametrize("sampling", ["wor", "poisson"])
def test_a_released_step_with_the_label_prior_bias_moves_at_most_lr_2c_over_b(sampling, batched):
    """fedpa.dp.label_prior: a fixed b added to the logits by the plugin's hook (post-processing of the count, the
    same on both neighbours) is inside DP-SGD's per-record losses, so a released step still moves at most lr 2C / b
    between neighbours; and b changes the steps (the hook is in the forward DP-SGD differentiates)."""
    C = 0.05
    bias, with_bias, without = torch.tensor([3.0]), [], []
    gaps, _ = _released_steps(frozenset(), sampling, batched, clip=C, bias=bias, moves_out=with_bias)
    _released_steps(frozenset(), sampling, batched, clip=C, moves_out=without)
    bound = 1.0 * 2 * C / B
    assert gaps[0] > 0.1 * bound, gaps
    assert max(gaps) <= bound * (1 + 1e-6) + 1e-9, (gaps, bound)
    changed = torch.cat([(with_bias[0][n] - without[0][n]).flatten() for n in without[0]]).norm()
    assert float(changed) > 1e-3 * bound  # the bias is in the loss DP-SGD clips


@pytest.mark.parametrize("frozen", [frozenset(), HEAD], ids=["head_noised", "head_frozen"])
@pytest.mark.parametrize("leak", LEAKS)
def test_the_step_check_fails_where_a_data_dependent_term_escapes_the_mechanism(leak, frozen):
    """The check above can fail: the drawn batch's exact loss added to what is backpropagated after the noise, or the
    head on the batch's exact gradient (the withdrawn 'plain'), moves a released step between neighbours far past
    lr 2C / b. (With the DP tensors at lr 0, as the check first ran, the first passed it: their clipped sums do not
    see a term added after the noise.)"""
    C = 0.05
    gaps, _ = _released_steps(frozen, "wor", True, leak=leak, clip=C)
    assert max(gaps) > 10 * (2 * C / B), gaps


def test_the_privacy_option_freezes_the_local_tensors_or_refuses():
    from fs_fedpa.privacy.sample_level import frozen_names

    assert frozen_names("frozen", sorted(HEAD)) == HEAD and frozen_names("noised", sorted(HEAD)) == frozenset()
    with pytest.raises(ValueError, match="no local tensor to freeze"):
        frozen_names("frozen", [])


@pytest.mark.parametrize("batched", [True, False], ids=["taps", "loop"])
def test_the_prefix_cache_takes_the_uncached_step(tiny_glue, batched):
    """LoRA on layer 1 of the 2-layer BERT, so the embeddings and layer 0 are a frozen prefix. Two DP-SGD steps (SGD,
    no noise, a clip that bites) with model.seqcls.prefix_cache and without (dropout off in both) move every trainable
    tensor alike; the second step's records are served from the cache where the first step computed them."""
    from federatedscope.core.configs.config import global_cfg
    from federatedscope.core.monitors.monitor import Monitor
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from fs_fedpa.plugin.prefix_cache import PrefixCache
    from fs_fedpa.plugin.seqcls import _encode, _trainer_class, build_seqcls_model
    from fs_fedpa.tasks.glue import get_task, load_glue

    cfg = global_cfg.clone()
    cfg.merge_from_list(["model.type", f"{tiny_glue['model']}@seqcls_llm", "model.seqcls.num_labels", 2,
                         "model.seqcls.lora_dropout", 0.0, "model.seqcls.layers_to_transform", [1], "trainer.type",
                         "seqcls", "criterion.type", "CrossEntropyLoss", "train.optimizer.type", "SGD",
                         "train.optimizer.lr", 1.0, "train.local_update_steps", 2, "train.batch_or_epoch", "batch",
                         "use_gpu", False])  # fmt: skip
    torch.manual_seed(0)
    model = _spread(_no_dropout(build_seqcls_model(cfg.model)))
    tokenizer = AutoTokenizer.from_pretrained(tiny_glue["model"])
    loader = DataLoader(_encode(load_glue(get_task("sst2"), tiny_glue["glue"], "train", limit=12), tokenizer, 32),
                        batch_size=6)  # fmt: skip
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    after, caches = {}, []
    for cached in (False, True):
        m = copy.deepcopy(model)
        if cached:
            caches.append(PrefixCache(m))
        trainer = _trainer_class()(m, {"train": loader}, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg))
        _dp_step(trainer, clip=0.05, batched=batched, b=8, steps=2)
        after[cached] = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    (cache,) = caches
    assert cache.first == 1 and cache.misses <= 12 and cache.hits > 0  # 16 records drawn of 12: some twice
    assert all(".layer.1." in n for n in start if "lora_" in n)
    for n in start:
        assert not torch.equal(after[False][n], start[n]), n
        torch.testing.assert_close(after[True][n] - start[n], after[False][n] - start[n], rtol=1e-4, atol=1e-8, msg=n)


def test_the_prefix_cache_is_refused_where_the_prefix_is_not_frozen():
    from federatedscope.core.configs.config import global_cfg

    with pytest.raises(ValueError, match="needs model.seqcls.layers_to_transform"):
        global_cfg.clone().merge_from_list(["model.seqcls.prefix_cache", True])
    with pytest.raises(ValueError, match="the frozen prefix would change under the cache"):
        global_cfg.clone().merge_from_list(["federate.method", "flora", "model.seqcls.prefix_cache", True,
                                            "model.seqcls.layers_to_transform", [1]])  # fmt: skip


def test_the_regimes_knobs_together_through_fs(tiny_glue, tmp_path):
    """DP-SGD with LoRA on the top layer only, the frozen prefix cached, a frozen local head, Poisson sampling, the
    PLD accountant and a cosine schedule: the run completes through FS, and its exported adapter adapts layer 1 only."""
    import json

    from tests.integration.test_export_fs import _run

    cfg, outdir = _run(tiny_glue, tmp_path, "fedpa", **{
        "model.seqcls.layers_to_transform": [1], "model.seqcls.prefix_cache": True, "fedpa.dp.mode": "sample",
        "fedpa.dp.clip": 1.0, "fedpa.dp.noise_multiplier": 1.0, "fedpa.dp.local_tensors": "frozen",
        "fedpa.dp.sampling": "poisson", "fedpa.dp.accountant": "pld", "fedpa.lr_schedule": "cosine",
        "fedpa.lr_warmup_steps": 1})  # fmt: skip
    log = (outdir / "exp_print.log").read_text()
    assert "prefix cache: embeddings and layers 0-0 computed once per record" in log
    adapter = json.loads((tmp_path / "at_end" / "global" / "adapter_config.json").read_text())
    assert adapter["target_modules"] and all(".layer.1." in m for m in adapter["target_modules"])


def test_the_dp_regime_config_passes_fs_and_the_plugins_checks():
    """yaml_configs/dp_sst2_minilm_cpu.yaml, as a user starts it: FS merges it and its checks (the plugin's
    among them) accept it when the config is frozen, with DP-SGD at ε = 8 on the selected regime's knobs."""
    import importlib
    from pathlib import Path

    from federatedscope.core.configs.config import global_cfg

    importlib.import_module("fs_fedpa")  # registers the plugin's config node and checks

    cfg = global_cfg.clone()
    cfg.merge_from_file(str(Path(__file__).resolve().parents[2] / "yaml_configs" / "dp_sst2_minilm_cpu.yaml"))
    cfg.freeze(save=False)  # FS's save would write config.yaml under the yaml's outdir, in the checkout
    assert (cfg.fedpa.dp.mode, cfg.fedpa.dp.epsilon, cfg.fedpa.dp.clip, cfg.fedpa.dp.sampling) == (
        "sample", 8.0, 0.01, "poisson")  # fmt: skip
    assert (cfg.dataloader.batch_size, cfg.train.local_update_steps, cfg.federate.total_round_num) == (256, 1, 120)
    assert cfg.model.seqcls.layers_to_transform == [4, 5] and cfg.personalization.local_param == ["classifier"]
    assert cfg.fedpa.dp.local_tensors == "frozen"  # inside the guarantee


def _restarted_starts(leak_own: bool, mu: float = 0.5, C: float = 0.05) -> tuple[float, float]:
    """fedpa_partial_restart after one released DP-SGD step, on the records and on the neighbour (same draw and
    noise): the two-layer model as a rank-2 LoRA pair (B, A) = (head weight (1, 2), body weight (2, 3)), the upload
    its factors after the step, and one reference (the server's release, the same for both). ``leak_own``: the
    restart reads factors that also took the batch's exact gradient step, outside the mechanism. Returns ||start on
    the records - start on the neighbour|| and the largest gap between a start and (1 - mu) upload + mu reference."""
    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.core.ranks import RankPlan
    from fs_fedpa.methods import get_method
    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.privacy.mechanism import dp_generator
    from fs_fedpa.privacy.sample_level import SamplePlan

    cls = get_method("fedpa_partial_restart")
    method = cls(FedPAConfig(methods={cls.name: cls.options(mu=mu)}), RankPlan.build(1, 2, client_ranks=[2]))
    g = torch.Generator().manual_seed(7)
    reference = {"m": (torch.randn(1, 2, generator=g), torch.randn(2, 3, generator=g))}
    seed = 3
    starts, off_formula = [], 0.0
    for neighbour in (None, _chosen(seed)[0]):
        trainer, model = _neighbour_trainer(neighbour, None)
        DPSGD(trainer, lambda n: SamplePlan(n, B, 1, 1.0, 1e-5, "wor"), lambda routine: dp_generator(seed, "t"),
              clip=C, batched=True)  # fmt: skip
        trainer.train()
        upload = {"m": (model[1].weight.detach().clone(), model[0].weight.detach().clone())}  # released
        own = upload
        if leak_own:
            X, y = trainer.ctx.data["train"].dataset.tensors
            loss = ((model(X) - y) ** 2).mean()
            gB, gA = torch.autograd.grad(loss, [model[1].weight, model[0].weight])
            own = {"m": (upload["m"][0] - gB, upload["m"][1] - gA)}
        start = method.start_round(reference, own, 0, 1)
        want = [(1 - mu) * u + mu * r for u, r in zip(upload["m"], reference["m"])]
        off_formula = max(off_formula, *(float((s - w).abs().max()) for s, w in zip(start["m"], want)))
        starts.append(torch.cat([t.flatten().double() for t in start["m"]]))
    return float((starts[0] - starts[1]).norm()), off_formula


def test_the_partial_restart_is_post_processing_of_released_tensors():
    """fedpa_partial_restart's start is (1 - mu) the client's upload + mu the reference, both released (checked
    against the formula here), so between neighbours it moves at most (1 - mu) lr 2C / b apart (lr 1)."""
    C, mu = 0.05, 0.5
    gap, off = _restarted_starts(False, mu, C)
    bound = (1 - mu) * 2 * C / B
    assert off < 1e-6, off
    assert 0.1 * bound < gap <= bound * (1 + 1e-6) + 1e-9, (gap, bound)


def test_the_restart_check_fails_where_it_mixes_in_factors_trained_outside_the_mechanism():
    """The check above can fail: a restart that mixes in the client's factors after an exact-gradient step (not its
    released upload) is off the formula and moves the start between neighbours far past (1 - mu) lr 2C / b."""
    C, mu = 0.05, 0.5
    gap, off = _restarted_starts(True, mu, C)
    assert off > 1e-3 and gap > 10 * (1 - mu) * 2 * C / B, (gap, off)


@pytest.mark.parametrize("batched", [True, False], ids=["taps", "loop"])
def test_a_grouped_head_is_clipped_apart_from_the_body(batched):
    """fedpa.dp.local_tensors grouped: each record's body gradient is clipped to C on the body's norm alone and its
    head gradient to C_h on the head's alone. Expected step from torch.func's per-example gradients (no noise)."""
    from torch.func import functional_call, grad, vmap

    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.privacy.mechanism import dp_generator
    from fs_fedpa.privacy.sample_level import SamplePlan

    C, C_h = 0.05, 0.02
    trainer, model, X, y = _two_layer_trainer()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    DPSGD(trainer, lambda n: SamplePlan(n, B, 1, 0.0, 1e-5, groups=2), lambda routine: dp_generator(3, "t"), clip=C,
          batched=batched, local=HEAD, local_clip=C_h)  # fmt: skip
    trainer.train()
    idx = _chosen()

    def loss(params, x, t):
        return ((functional_call(model, params, (x[None],)) - t) ** 2).mean()

    per = vmap(grad(loss), in_dims=(None, 0, 0))(before, X[idx], y[idx])
    scale = {}
    for names, clip in ((sorted(set(before) - HEAD), C), (sorted(HEAD), C_h)):
        norms = sum(per[n].flatten(1).pow(2).sum(1) for n in names).sqrt()
        c = torch.clamp(clip / norms, max=1.0)
        assert (c < 1).all()  # the clip bites on every record, in each group
        scale.update({n: c for n in names})
    for n, p in model.named_parameters():
        c = scale[n].view(-1, *[1] * (per[n].ndim - 1))
        torch.testing.assert_close(p.detach(), before[n] - (c * per[n]).sum(0) / B, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batched", [True, False], ids=["taps", "loop"])
@pytest.mark.parametrize("sampling", ["wor", "poisson"])
def test_a_grouped_released_step_moves_each_group_at_most_lr_2cg_over_b_between_neighbours(sampling, batched):
    """fedpa.dp.local_tensors grouped, C = 0.05 on the body and C_h = 0.2 on the head: between neighbours
    (replace-one, the same draw and noise) a released step (SGD lr 1, noise on) moves the body at most 2C/b apart and
    the head at most 2C_h/b apart, the bounds the accounting's sensitivity sqrt(2) per rescaled group rests on."""
    C, C_h = 0.05, 0.2
    gaps, _ = _released_steps(frozenset(), sampling, batched, clip=C, local=HEAD, local_clip=C_h)
    body, head = zip(*gaps)
    assert body[0] > 0.1 * 2 * C / B and head[0] > 0.1 * 2 * C_h / B, gaps  # the canary is drawn and moves both
    assert max(body) <= 2 * C / B * (1 + 1e-6) + 1e-9, (body, 2 * C / B)
    assert max(head) <= 2 * C_h / B * (1 + 1e-6) + 1e-9, (head, 2 * C_h / B)
    assert max(head) > 2 * C / B  # the head's own clip, not C, bounds it


GROUPED_LEAKS = ("head_unclipped", "body_unclipped")


def _remove_grouped_clip(monkeypatch, leak: str) -> None:
    """The grouped clip replaced in both per-example paths by one that leaves the head (``head_unclipped``) or the
    body (``body_unclipped``) unclipped, the other group clipped as before."""
    import math

    from fs_fedpa.plugin import dp_sgd
    from fs_fedpa.privacy.mechanism import add_clipped_groups
    from fs_fedpa.privacy.per_example import clipped_sum_groups

    def opened(clips):
        return (clips[0], math.inf) if leak == "head_unclipped" else (math.inf, clips[1])

    monkeypatch.setattr(dp_sgd, "clipped_sum_groups",
                        lambda g, cols, clips: clipped_sum_groups(g, cols, opened(clips)))  # fmt: skip
    monkeypatch.setattr(dp_sgd, "add_clipped_groups",
                        lambda t, g, groups, clips: add_clipped_groups(t, g, groups, opened(clips)))  # fmt: skip


@pytest.mark.parametrize("batched", [True, False], ids=["taps", "loop"])
@pytest.mark.parametrize("leak", GROUPED_LEAKS)
def test_the_grouped_step_check_fails_where_the_groups_clip_is_removed(monkeypatch, leak, batched):
    """The check above can fail: with the head's group left unclipped, the head's step moves far past 2C_h/b between
    neighbours; with the body's left unclipped, the body's moves far past 2C/b."""
    C, C_h = 0.05, 0.2
    _remove_grouped_clip(monkeypatch, leak)
    gaps, _ = _released_steps(frozenset(), "wor", batched, clip=C, local=HEAD, local_clip=C_h)
    body, head = zip(*gaps)
    print(f"{leak} ({'taps' if batched else 'loop'}): body gaps {body} (bound {2 * C / B:g}), head gaps {head} "
          f"(bound {2 * C_h / B:g})")  # fmt: skip
    if leak == "head_unclipped":
        assert max(head) > 10 * (2 * C_h / B), head
    else:
        assert max(body) > 10 * (2 * C / B), body


def test_each_groups_noise_is_z_sqrt2_times_its_clip_over_b():
    """Zero data and weights: a grouped step (SGD lr 1) is its noise over b alone; per group its entries have standard
    deviation z_g C_g / b with z_g = z sqrt(2), the accounted z (empirical, over 8,000 body and 2,001 head
    entries): the noise the accounting of z at sensitivity 1 rests on."""
    import math

    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.privacy.mechanism import dp_generator
    from fs_fedpa.privacy.sample_level import SamplePlan

    z, C, C_h = 1.5, 0.05, 0.2
    trainer, model, X, y = _two_layer_trainer(zero_data=True, hidden=2000)
    DPSGD(trainer, lambda n: SamplePlan(n, B, 1, z, 1e-5, groups=2), lambda routine: dp_generator(5, "t"), clip=C,
          local=HEAD, local_clip=C_h)  # fmt: skip
    trainer.train()
    step = {n: p.detach().double().flatten() for n, p in model.named_parameters()}
    body = torch.cat([step[n] for n in step if n not in HEAD])
    head = torch.cat([step[n] for n in sorted(HEAD)])
    for moved, clip in ((body, C), (head, C_h)):
        expected = z * math.sqrt(2) * clip / B
        assert abs(float(moved.std()) / expected - 1) < 0.1, (float(moved.std()), expected)


def test_the_grouped_option_groups_the_local_tensors_or_refuses():
    from fs_fedpa.privacy.sample_level import frozen_names, grouped_names

    assert grouped_names("grouped", sorted(HEAD)) == HEAD and frozen_names("grouped", sorted(HEAD)) == frozenset()
    assert grouped_names("frozen", sorted(HEAD)) == frozenset() == grouped_names("noised", sorted(HEAD))
    with pytest.raises(ValueError, match="'grouped' with no local tensor to group"):
        grouped_names("grouped", [])


def test_the_studys_grouped_variant_passes_fs_and_the_plugins_checks():
    """The declared study's ``var_grouped`` override list (fedpa.dp.local_tensors grouped and fedpa.dp.local_clip
    beside the flat fedpa.dp_* keys) on the study's yaml, as FS merges it for method fedpa: its checks accept it when
    frozen."""
    import importlib

    from federatedscope.core.configs.config import global_cfg

    importlib.import_module("fs_fedpa")
    from research.study.sst2_dp_fedpa import POINT, variants
    from research.study.sst2_protocol import CFG_NAME
    from tests.conftest import ROOT

    (run,) = [r for r in variants(0.1) if r.name == "var_grouped"]
    cfg = global_cfg.clone()
    cfg.merge_from_file(str(ROOT / CFG_NAME))
    cfg.merge_from_list(["federate.method", run.method, *run.opts])
    cfg.freeze(save=False)
    dp = cfg.fedpa.dp
    assert (dp.mode, dp.local_tensors, dp.local_clip) == ("sample", "grouped", POINT.clip)
    assert cfg.fedpa.dp.clip == POINT.clip and cfg.personalization.local_param == ["classifier"]


@pytest.mark.parametrize("treatment", ["frozen", "grouped"])
def test_a_grouped_head_trains_through_fs_within_the_target(tiny_glue, tmp_path, treatment):
    """DP-SGD through FS on the tiny BERT with local classifier heads (Poisson, PLD, epsilon 8): under 'grouped' each
    client's exported head has left the initial one all clients share (under 'frozen', the control, none has); the
    ledger and each client's own file state the groups and the head's clip, every epsilon within the target, and
    the server admitted every client's account (the two compute one plan)."""
    import json

    from safetensors.torch import load_file

    from fs_fedpa.record import PRIVATE_FAULTS_FILE
    from tests.integration.test_export_fs import _run

    C, C_h = 0.5, 2.0
    dp = {"fedpa.dp.mode": "sample", "fedpa.dp.clip": C, "fedpa.dp.epsilon": 8.0, "fedpa.dp.horizon": 5,
          "fedpa.dp.sampling": "poisson", "fedpa.dp.accountant": "pld",
          "fedpa.dp.local_tensors": treatment}  # fmt: skip
    if treatment == "grouped":
        dp["fedpa.dp.local_clip"] = C_h
    cfg, outdir = _run(tiny_glue, tmp_path, "fedpa", **dp)
    heads = [load_file(str(p)) for p in sorted((tmp_path / "at_end" / "heads").glob("client_*.safetensors"))]
    assert len(heads) == 3
    moved = [any(not torch.equal(h[k], heads[0][k]) for k in h) for h in heads[1:]]
    last = json.loads((outdir / "fedpa_privacy.jsonl").read_text().splitlines()[-1])
    own = [json.loads(line) for line in (outdir / "fedpa_client_privacy.jsonl").read_text().splitlines()]
    assert last["dp_epsilon"] <= 8.0 and "dp_no_guarantee" not in last and len(last["dp_clients"]) == 3
    assert all(e["epsilon"] <= 8.0 for e in last["dp_clients"].values())
    faults = outdir / PRIVATE_FAULTS_FILE  # a refused account would be written here
    assert not faults.exists() or not faults.read_text().strip()
    if treatment == "frozen":
        assert not any(moved) and "dp_groups" not in last and all("groups" not in r for r in own)
        return
    assert all(moved)
    assert (last["dp_groups"], last["dp_clip_local"], last["dp_clip"]) == (2, C_h, C)
    assert own and all(r["groups"] == 2 and r["clip_local"] == C_h for r in own)
    assert "2 clipping groups, the local tensors' at C_h=2" in (outdir / "exp_print.log").read_text()
