"""``fedpa.keep_moments`` in FS's own trainer: two training routines (rounds) with the client's AdamW state kept
between them are one AdamW run over both rounds' gradients, replayed here through a fresh ``torch.optim.AdamW``
(an independent computation). Under sample-level DP-SGD the gradients the optimizer receives are the mechanism's
(noised clipped sum plus a data-free term), so moments that equal the replay of those gradients hold nothing else:
post-processing. Each check is shown to fail: fresh moments every round, and moments that also took the batch's
exact gradient outside the mechanism."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.integration

N, B, LR, STEPS = 12, 4, 0.01, 2


def _trainer():
    """FS's trainer on a two-layer model, AdamW at lr 0.01 (torch's other defaults), STEPS batches a routine."""
    from federatedscope.core.configs.config import global_cfg
    from federatedscope.core.monitors.monitor import Monitor
    from federatedscope.core.trainers import GeneralTorchTrainer

    cfg = global_cfg.clone()
    cfg.merge_from_list(["train.optimizer.type", "AdamW", "train.optimizer.lr", LR, "train.local_update_steps", STEPS,
                         "train.batch_or_epoch", "batch", "dataloader.batch_size", B, "criterion.type", "MSELoss",
                         "use_gpu", False])  # fmt: skip
    torch.manual_seed(2)
    X, y = torch.randn(N, 3), torch.randn(N, 1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    data = {"train": DataLoader(TensorDataset(X, y), batch_size=B, shuffle=True)}
    return GeneralTorchTrainer(model, data, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg)), model


def _two_rounds(keep: bool, dp: bool, leak: bool = False):
    """Two routines of ``_trainer``; returns the initial parameters, every step's gradients as the optimizer received
    them (``name -> p.grad``, recorded by a step pre-hook), the final parameters and the kept moments (``keep``).
    ``dp``: sample-level DP-SGD (clip 0.05, z 1) with a data-free term; ``leak``: after each step the moments also
    take the batch's exact gradient (the mechanism removed for them)."""
    from fs_fedpa.core.moments import KeptMoments
    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.plugin.trainer import install_moments_hook
    from fs_fedpa.privacy.mechanism import dp_generator
    from fs_fedpa.privacy.sample_level import SamplePlan

    trainer, model = _trainer()
    names = {id(p): n for n, p in model.named_parameters()}
    kept = SimpleNamespace(moments=KeptMoments())
    if keep:
        install_moments_hook(trainer, kept)
    if dp:

        def data_free(ctx):
            ctx.loss_task = ctx.loss_task + 0.05 * sum((p**2).sum() for p in model.parameters())

        trainer.register_hook_in_train(new_hook=data_free, trigger="on_batch_forward")
        hooks = DPSGD(trainer, lambda n: SamplePlan(n, B, STEPS, 1.0, 1e-5, "wor"),
                      lambda routine: dp_generator(5, "t"), clip=0.05, batched=True)  # fmt: skip
    if leak:

        def exact_into_moments(ctx):
            inputs, target = ctx.data_batch
            params = [p for p in model.parameters() if p in ctx.optimizer.state]
            grads = torch.autograd.grad(((model(inputs) - target) ** 2).mean(), params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    ctx.optimizer.state[p]["exp_avg"].add_(g, alpha=0.1)

        trainer.register_hook_in_train(new_hook=exact_into_moments, trigger="on_batch_end", insert_pos=0)
    initial = copy.deepcopy(model.state_dict())
    seen = []

    def record(optimizer, args, kwargs):
        seen.append({names[id(p)]: p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]
                     if p.grad is not None})  # fmt: skip

    handle = register_optimizer_step_pre_hook(record)
    try:
        for _ in range(2):
            if dp:
                hooks.new_round()
            trainer.train()
            trainer.ctx.optimizer = None  # as the client does after each routine (release_optimizer)
    finally:
        handle.remove()
    assert len(seen) == 2 * STEPS
    return initial, seen, {n: p.detach().clone() for n, p in model.named_parameters()}, kept.moments.tensors


def _replay(initial, seen):
    """One fresh torch AdamW (lr 0.01, torch's defaults) over ``seen``'s gradients from ``initial``: its parameters
    and its state as ``"<name>:<key>"``."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    model.load_state_dict(initial)
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(params.values(), lr=LR)
    for grads in seen:
        for n, p in params.items():
            p.grad = grads.get(n)
        optimizer.step()
    state = {f"{n}:{k}": v for n, p in params.items() for k, v in optimizer.state.get(p, {}).items()}
    return {n: p.detach() for n, p in params.items()}, state


def _gap(dp: bool, keep: bool = True, leak: bool = False) -> tuple[float, float]:
    """The largest difference of the parameters, and of the kept moments, from the replay's."""
    initial, seen, final, moments = _two_rounds(keep, dp, leak)
    params, state = _replay(initial, seen)
    param_gap = max(float((final[n] - params[n]).abs().max()) for n in params)
    if not keep:
        return param_gap, float("nan")
    assert set(moments) == set(state), (sorted(moments), sorted(state))
    return param_gap, max(float((moments[k] - state[k].float()).abs().max()) for k in state)


def test_kept_moments_make_two_rounds_one_adamw_run_and_fresh_ones_do_not():
    """Without DP: round 2's steps with the kept state are those of one AdamW over both rounds' gradients; a fresh
    optimizer each round (the default) restarts the bias correction and the moments, which the check sees."""
    param_gap, moment_gap = _gap(dp=False)
    assert param_gap < 1e-7 and moment_gap < 1e-7, (param_gap, moment_gap)
    fresh_gap, _ = _gap(dp=False, keep=False)
    assert fresh_gap > 1e-4, fresh_gap


def test_under_dp_sgd_the_kept_moments_are_the_replay_of_the_mechanism_s_gradients():
    """Post-processing: under sample-level DP-SGD the kept moments and the parameters are those of a fresh AdamW fed
    only the gradients the optimizer received (the noised clipped sum plus the data-free term)."""
    param_gap, moment_gap = _gap(dp=True)
    assert param_gap < 1e-7 and moment_gap < 1e-7, (param_gap, moment_gap)


def test_the_replay_check_fails_where_the_moments_take_an_exact_gradient():
    """The check above can fail: moments that also took the batch's exact gradient (outside the mechanism) are off
    the replay, and so are the parameters they move."""
    param_gap, moment_gap = _gap(dp=True, leak=True)
    assert moment_gap > 1e-3 and param_gap > 1e-4, (param_gap, moment_gap)
