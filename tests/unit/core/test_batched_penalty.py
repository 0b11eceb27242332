"""ProductTerm (the product penalty batched by shape, its gradient in closed form) against autograd through the
dense (d, k) products, and its operator count against the number of modules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fs_fedpa.core.batched_penalty import ProductTerm
from fs_fedpa.core.penalty import product_penalty

SHAPES = [(12, 9, 3, 2), (12, 9, 3, 2), (7, 11, 2, 4), (12, 9, 3, 2), (7, 11, 2, 4)]  # (d, k, r, R) per module


def _modules(seed: int, shapes=SHAPES, dtype=torch.float32, near: float | None = None):
    """Live parameters, a reference (``near``: the live product plus noise of that size) and a fixed task weight."""
    g = torch.Generator().manual_seed(seed)
    live, reference, task = {}, {}, {}
    for i, (d, k, r, R) in enumerate(shapes):
        B, A = torch.randn(d, r, generator=g), torch.randn(r, k, generator=g)
        if near is None:
            B_r, A_r = torch.randn(d, R, generator=g), torch.randn(R, k, generator=g)
        else:  # the reference is the live product, written with another factorisation of rank R >= r, plus noise
            B_r = torch.cat([B * 2, torch.randn(d, R - r, generator=g) * near], 1)
            A_r = torch.cat([A / 2, torch.randn(R - r, k, generator=g)], 0)
        live[f"m{i}"] = (nn.Parameter(B.to(dtype)), nn.Parameter(A.to(dtype)))
        reference[f"m{i}"] = (B_r.to(dtype), A_r.to(dtype))
        task[f"m{i}"] = (torch.randn(d, r, generator=g), torch.randn(r, k, generator=g))
    return live, reference, task


def _task_loss(live, task) -> torch.Tensor:
    return sum(((B * X).sum() + (A * Y).sum()).square() for (B, A), (X, Y) in zip(live.values(), task.values()))


def _dense(live, reference, task, coef: float, with_task: bool = True):
    """Independent reference: value and gradients through the dense products, in float64, by autograd."""
    copies = {n: (B.detach().double().requires_grad_(), A.detach().double().requires_grad_()) for n, (B, A) in
              live.items()}  # fmt: skip
    term = coef * sum((B @ A - B_r.double() @ A_r.double()).square().sum() for (B, A), (B_r, A_r) in
                      zip(copies.values(), reference.values()))  # fmt: skip
    loss = term + (_task_loss(copies, {n: (X.double(), Y.double()) for n, (X, Y) in task.items()}) if with_task else 0)
    loss.backward()
    return float(term.detach()), {n: (B.grad, A.grad) for n, (B, A) in copies.items()}


def _assert_grads(live, expected, rtol=1e-5):
    for n, (B, A) in live.items():
        for p, e in ((B, expected[n][0]), (A, expected[n][1])):
            scale = float(e.abs().max()) + 1e-12
            torch.testing.assert_close(p.grad.double(), e, atol=rtol * scale, rtol=rtol)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), coef=st.floats(0.01, 10.0), task=st.booleans())
def test_value_and_gradients_equal_autograd_on_the_dense_products(seed, coef, task):
    # Prepare: modules of two shapes, r != R; with or without a task gradient accumulated before the term's
    live, reference, weights = _modules(seed)
    term = ProductTerm(live, reference)
    # Execute
    value = term(coef)
    loss = value + _task_loss(live, weights) if task else value
    loss.backward()
    # Assert
    ref_value, ref_grads = _dense(live, reference, weights, coef, with_task=task)
    assert float(value) == pytest.approx(ref_value, rel=1e-4)
    _assert_grads(live, ref_grads)


def test_the_gradient_follows_the_upstream_gradient_and_several_backwards_accumulate():
    """grad_out scales it (a GradScaler's scale, 1/accumulation steps), and two backwards add up, as autograd's."""
    live, reference, weights = _modules(1)
    term = ProductTerm(live, reference)
    for _ in range(2):
        (0.25 * (term(3.0) + _task_loss(live, weights))).backward()
    _, ref_grads = _dense(live, reference, weights, 3.0)
    _assert_grads(live, {n: (0.5 * B, 0.5 * A) for n, (B, A) in ref_grads.items()})


def test_it_follows_the_parameters_as_an_optimizer_steps_and_releases_them_unchanged():
    live, reference, weights = _modules(2)
    term = ProductTerm(live, reference)
    optimizer = torch.optim.Adam([p for pair in live.values() for p in pair], lr=0.05)
    for _ in range(3):
        optimizer.zero_grad()
        (term(0.7) + _task_loss(live, weights)).backward()
        optimizer.step()
    optimizer.zero_grad()
    (term(0.7) + _task_loss(live, weights)).backward()
    ref_value, ref_grads = _dense(live, reference, weights, 0.7)
    _assert_grads(live, ref_grads)
    values = {n: (B.detach().clone(), A.detach().clone()) for n, (B, A) in live.items()}
    term.release()
    pointers = {p.data_ptr() for pair in live.values() for p in pair}
    assert len(pointers) == 2 * len(live)  # each on a storage of its own again
    for n, (B, A) in live.items():
        assert torch.equal(B, values[n][0]) and torch.equal(A, values[n][1])


def test_a_replaced_storage_is_stacked_again():
    live, reference, weights = _modules(3)
    term = ProductTerm(live, reference)
    B = live["m0"][0]
    B.data = B.data.clone() + 1.0  # e.g. moved: the stack no longer holds it
    (term(1.0) + _task_loss(live, weights)).backward()
    _, ref_grads = _dense(live, reference, weights, 1.0)
    _assert_grads(live, ref_grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_and_half_parameters(dtype):
    """Under autocast the term computes in float32 (as product_penalty would have outside it); half-precision
    parameters get gradients of their dtype equal to the float32 closed form rounded."""
    live, reference, weights = _modules(4)
    term = ProductTerm(live, reference)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = term(0.5)
    value.backward()
    ref_value, ref_grads = _dense(live, reference, weights, 0.5, with_task=False)
    assert value.dtype == torch.float32 and float(value) == pytest.approx(ref_value, rel=1e-4)
    _assert_grads(live, ref_grads)
    half, reference_h, _ = _modules(4, dtype=dtype)
    ProductTerm(half, reference_h)(0.5).backward()
    for n, (B, A) in half.items():
        assert B.grad.dtype == dtype
        torch.testing.assert_close(B.grad.float(), ref_grads[n][0].float(), atol=0.05 * float(ref_grads[n][0].abs().max()),
                                   rtol=0.02)  # fmt: skip


def test_it_equals_todays_autograd_term_under_autocast_to_bf16_rounding():
    live, reference, weights = _modules(5)
    plain = {n: (nn.Parameter(B.detach().clone()), nn.Parameter(A.detach().clone())) for n, (B, A) in live.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        old = 0.5 * sum(product_penalty(B, A, *reference[n]) for n, (B, A) in plain.items())
        new = ProductTerm(live, reference)(0.5)
    old.backward()
    new.backward()
    assert float(new) == pytest.approx(float(old), rel=0.03)
    for n in live:
        for p, q in zip(live[n], plain[n]):
            torch.testing.assert_close(p.grad, q.grad, atol=0.03 * float(q.grad.abs().max()), rtol=0.03)


def test_the_recorded_value_is_accurate_where_the_gram_expansion_cancels():
    """Near convergence (the product within 1e-4 of the reference) the float32 Gram expansion loses the value;
    ProductTerm.value, from QR factors in float64, matches the dense float64 norm."""
    live, reference, weights = _modules(6, shapes=[(256, 192, 4, 8)] * 3, near=1e-4)
    term = ProductTerm(live, reference)
    dense, _ = _dense(live, reference, weights, 1.0, with_task=False)
    assert term.value(1.0) == pytest.approx(dense, rel=1e-6)
    assert abs(float(term(1.0)) - dense) > 1e-3 * dense  # the training value's expansion does cancel here


def test_the_alignment_part_of_the_gradient_is_reported():
    live, reference, weights = _modules(7)
    seen = []
    term = ProductTerm(live, reference, on_alignment_sq=seen.append)
    term(2.0).backward()
    _, ref_grads = _dense(live, reference, weights, 2.0, with_task=False)
    expected = sum(float(B.square().sum() + A.square().sum()) for B, A in ref_grads.values())
    assert len(seen) == 2 and float(sum(seen)) == pytest.approx(expected, rel=1e-4)  # one a shape group


def _aten_calls(n_modules: int) -> int:
    """aten calls one step of the term adds, over a task step, with ``n_modules`` modules of one shape."""
    from torch.profiler import ProfilerActivity, profile

    live, reference, weights = _modules(8, shapes=[(16, 16, 4, 4)] * n_modules)
    term = ProductTerm(live, reference)

    def count(with_term: bool) -> int:
        for p in (p for pair in live.values() for p in pair):
            p.grad = None
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = _task_loss(live, weights)
            (loss + term(1.0) if with_term else loss).backward()
        return sum(e.name.startswith("aten::") for e in prof.events())

    return count(True) - count(False)


def test_a_step_adds_the_same_few_operator_calls_whatever_the_number_of_modules():
    """The term adds at most 64 aten calls a step for a group of one shape, 4 modules or 32 (product_penalty
    through autograd: about 160 a module)."""
    few, many = _aten_calls(4), _aten_calls(32)
    assert few <= 64 and many <= 64, (few, many)
    assert few == many


@pytest.mark.parametrize("one", ["kept", "dropped", "replaced"])
def test_gradients_not_reset_between_steps_accumulate_in_place(one):
    """An optimizer whose zero_grad keeps the tensors (set_to_none=False): the rows the term handed out as .grad are
    zeroed and accumulated into; with one factor's gradient dropped or replaced by a tensor of its own, a mixed
    step; each equals autograd."""
    live, reference, weights = _modules(9)
    term = ProductTerm(live, reference)
    optimizer = torch.optim.SGD([p for pair in live.values() for p in pair], lr=0.0)
    (term(1.0) + _task_loss(live, weights)).backward()
    optimizer.zero_grad(set_to_none=False)
    B = live["m1"][0]
    if one != "kept":
        B.grad = None if one == "dropped" else torch.zeros_like(B)
    (term(1.0) + _task_loss(live, weights)).backward()
    _, ref_grads = _dense(live, reference, weights, 1.0)
    _assert_grads(live, ref_grads)


def test_the_gradient_split_moves_no_bit_of_the_gradient():
    """Full diagnostics read the term's gradient norm; the gradients the factors get are the same bits as without."""
    grads = []
    for watched in (False, True):
        live, reference, weights = _modules(10)
        term = ProductTerm(live, reference, on_alignment_sq=(lambda sq: None) if watched else None)
        (term(0.3) + _task_loss(live, weights)).backward()
        grads.append([p.grad.clone() for pair in live.values() for p in pair])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
