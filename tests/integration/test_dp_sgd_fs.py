"""DP-SGD's hooks in FS's own GeneralTorchTrainer, against per-example gradients from torch.func on a linear model
(an independent computation), for the records the DP generator draws."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.integration

N, B = 10, 4


def _trainer(lr: float = 1.0, extra_hook=None, zero_data: bool = False):
    from federatedscope.core.configs.config import global_cfg
    from federatedscope.core.monitors.monitor import Monitor
    from federatedscope.core.trainers import GeneralTorchTrainer

    cfg = global_cfg.clone()
    cfg.merge_from_list(["train.optimizer.type", "SGD", "train.optimizer.lr", lr, "train.local_update_steps", 1,
                         "train.batch_or_epoch", "batch", "dataloader.batch_size", B, "criterion.type", "MSELoss",
                         "use_gpu", False])  # fmt: skip
    torch.manual_seed(0)
    X, y = torch.randn(N, 3), torch.randn(N, 1)
    model = torch.nn.Linear(3, 1)
    if zero_data:  # every per-example gradient is 0: a step is its noise alone
        X, y = X * 0, y * 0
        torch.nn.init.zeros_(model.bias)
    data = {"train": DataLoader(TensorDataset(X, y), batch_size=B, shuffle=True)}
    trainer = GeneralTorchTrainer(model, data, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg))
    if extra_hook is not None:
        trainer.register_hook_in_train(new_hook=extra_hook, trigger="on_batch_forward")
    return trainer, model, X, y


def _dp_step(trainer, clip: float, z: float = 0.0, seed: int = 3):
    from fs_fedpa.core.dp import dp_generator
    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.plugin.privacy import SamplePlan

    dp = DPSGD(trainer, lambda n: SamplePlan(n, B, 1, z, 1e-5), lambda routine: dp_generator(seed, "t"), clip=clip)
    trainer.train()
    return dp


def _per_example_grads(weight, bias, X, y):
    """(n, 1, 3) and (n, 1): the gradient of (w x + b - y)^2 per record, by torch.func.vmap."""
    from torch.func import grad, vmap

    def loss(w, b, x, t):
        return ((x @ w.T + b - t) ** 2).mean()

    return vmap(grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0))(weight, bias, X, y)


def _chosen(seed: int = 3) -> list[int]:
    from fs_fedpa.core.dp import dp_generator, sample_without_replacement

    return sample_without_replacement(N, B, dp_generator(seed, "t"))


@pytest.mark.parametrize("clip", [1e9, 0.3])
def test_step_is_the_mean_of_clipped_per_example_gradients(clip):
    trainer, model, X, y = _trainer()
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    _dp_step(trainer, clip)
    idx = _chosen()
    gw, gb = _per_example_grads(w0, b0, X[idx], y[idx])
    norms = (gw.flatten(1).pow(2).sum(1) + gb.flatten(1).pow(2).sum(1)).sqrt()
    c = torch.clamp(clip / norms, max=1.0)
    assert (c < 1).any() == (clip < 1)  # the small clip bites, the large one does not
    expected_w = w0 - (c[:, None, None] * gw).sum(0) / B
    expected_b = b0 - (c[:, None] * gb).sum(0) / B
    torch.testing.assert_close(model.weight.detach(), expected_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.bias.detach(), expected_b, rtol=1e-5, atol=1e-6)


def test_data_free_term_is_added_after_clipping():
    from federatedscope.core.trainers.context import CtxVar
    from federatedscope.core.trainers.enums import LIFECYCLE

    lam = 0.7

    def alignment(ctx):  # like FedPA's alignment hook: a term that reads no record
        ctx.loss_task = CtxVar(ctx.loss_task + 0.5 * lam * ctx.model.weight.pow(2).sum(), LIFECYCLE.BATCH)

    trainer, model, X, y = _trainer(extra_hook=alignment)
    w0 = model.weight.detach().clone()
    _dp_step(trainer, clip=1e-12)
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
