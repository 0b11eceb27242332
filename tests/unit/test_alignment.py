"""The client's alignment term as training runs it (plugin.alignment.Alignment): FedPA-LoRA's product penalty,
batched with its gradient in closed form, trains the factors exactly as the method's autograd term would, for every
method that uses it, with r != R and each adaptive-lambda rule; the recorded value is the term at the round's end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fs_fedpa.config import FedPAConfig
from fs_fedpa.core.ranks import RankPlan
from fs_fedpa.methods import METHODS, get_method
from fs_fedpa.plugin.alignment import Alignment

SHAPES = {"q": (10, 8), "v": (6, 8), "o": (10, 8)}  # (d, k)
r, R = 3, 5


def _method(name: str, adaptive: str):
    get_method(name)  # registers every method
    plan = RankPlan.build(1, R, client_ranks=[r], reference_ranks=[R])
    return METHODS[name](FedPAConfig(lam=0.7, adaptive_lam=adaptive), plan)


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    live = {n: (nn.Parameter(torch.randn(d, r, generator=g)), nn.Parameter(torch.randn(r, k, generator=g)))
            for n, (d, k) in SHAPES.items()}  # fmt: skip
    reference = {n: (torch.randn(d, R, generator=g), torch.randn(R, k, generator=g)) for n, (d, k) in SHAPES.items()}
    data = {n: torch.randn(k, generator=g) for n, (d, k) in SHAPES.items()}
    return live, reference, data


def _task(live, data):
    return sum(torch.tanh(B @ (A @ data[n])).square().sum() for n, (B, A) in live.items())


def _train(name: str, adaptive: str, batched: bool, steps: int = 3):
    """A round of ``steps`` SGD steps on the task + the term; the factors' gradients each step, lambda, the value."""
    method = _method(name, adaptive)
    if not batched:
        method.product_alignment = lambda: False  # the method's own term through autograd, as before
    live, reference, data = _state(0)
    alignment = Alignment(method, watched=False)
    alignment.penalty_weight = 0.5
    alignment.start_round(live, reference)
    assert (alignment.batched is not None) == batched
    params = [p for pair in live.values() for p in pair]
    optimizer = torch.optim.SGD(params, lr=0.01)
    grads = []
    for _ in range(steps):
        optimizer.zero_grad()
        task = _task(live, data)
        term = alignment.term(SimpleNamespace(loss_batch=task, skip_this_batch=False))
        (task + term).backward()
        grads.append([p.grad.clone() for p in params])
        optimizer.step()
    value = alignment.value()
    alignment.clear()
    return grads, alignment.lam, value, live


@pytest.mark.parametrize("adaptive", ["none", "loss", "grad", "direction"])
@pytest.mark.parametrize("name", ["fedpa", "fedpa_no_preservation"])
def test_the_batched_term_trains_as_the_methods_autograd_term(name, adaptive):
    grads, lam, value, live = _train(name, adaptive, batched=True)
    want_grads, want_lam, _, want_live = _train(name, adaptive, batched=False)
    assert lam == pytest.approx(want_lam, rel=1e-6)
    for step, want in zip(grads, want_grads):
        for g, w in zip(step, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))
    for n in live:
        for p, q in zip(live[n], want_live[n]):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    # the recorded value: lam/2 * weight * sum ||B A - B_r A_r||^2 on the trained factors, against the dense products
    _, reference, _ = _state(0)
    dense = sum(float((B.detach().double() @ A.detach().double() - reference[n][0].double() @ reference[n][1].double())
                      .square().sum()) for n, (B, A) in live.items())  # fmt: skip
    assert value == pytest.approx(0.5 * lam * 0.5 * dense, rel=1e-9)


def test_no_term_no_value_and_a_zero_lambda_adds_none():
    method = _method("fedpa", "none")
    live, reference, data = _state(1)
    alignment = Alignment(method, watched=False)
    alignment.start_round(live, reference)
    assert alignment.value() == 0.0  # no step trained with it yet
    alignment.lam = 0.0
    assert alignment.term(SimpleNamespace(loss_batch=_task(live, data))) is None
    with alignment.paused():
        alignment.lam = 0.7
        assert alignment.term(SimpleNamespace(loss_batch=_task(live, data))) is None
    alignment.clear()
    assert len({p.data_ptr() for pair in live.values() for p in pair}) == 2 * len(live)  # released


def test_the_gradient_split_sees_the_term_and_the_task_apart():
    """Full diagnostics: ||grad of the term|| and ||grad of the task|| of the round's first step, against autograd
    of each alone."""
    method = _method("fedpa", "none")
    live, reference, data = _state(2)
    alignment = Alignment(method, watched=True)
    alignment.start_round(live, reference)
    task = _task(live, data)
    (task + alignment.term(SimpleNamespace(loss_batch=task))).backward()
    alignment.grads.close()
    align_norm, task_norm = alignment.grads.norms()["first"]
    params = [p for pair in live.values() for p in pair]
    want_task = torch.autograd.grad(_task(live, data), params)
    term = 0.5 * 0.7 * sum((B @ A - reference[n][0] @ reference[n][1]).square().sum() for n, (B, A) in live.items())
    want_align = torch.autograd.grad(term, params)
    assert task_norm == pytest.approx(float(torch.cat([g.flatten() for g in want_task]).norm()), rel=1e-5)
    assert align_norm == pytest.approx(float(torch.cat([g.flatten() for g in want_align]).norm()), rel=1e-5)
    alignment.clear()
