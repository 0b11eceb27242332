"""Per-example gradients from batched taps (fs_fedpa.privacy.per_example) against autograd on each record alone, on
LoRA-shaped stacks of nn.Linear; the clipped sum against fs_fedpa.privacy.mechanism.add_clipped record by record;
the flat forms DP-SGD takes (one (b, P) matrix, a fixed number of operations) against the per-tensor computations;
and the refusals (a module that mixes records, a tensor outside a plain nn.Linear, a weight read outside its
forward)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fs_fedpa.privacy.mechanism import add_clipped
from fs_fedpa.privacy.per_example import (
    LinearTaps,
    check_sum,
    clipped_sum,
    clipped_sum_flat,
    describe_gaps,
    linear_owners,
    per_example_grads,
    per_example_matrix,
    sum_gaps,
    sum_mismatch,
)

SETTINGS = settings(max_examples=30, deadline=None)


class LoraStack(nn.Module):
    """x -> W x + s B A x (frozen W, trainable A and B), a nonlinearity, the same LoRA block again (a module called
    twice), a trainable head with bias; the loss of a record reads its own row only."""

    def __init__(self, k: int, r: int, classes: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.W = nn.Linear(k, k)
        self.W.requires_grad_(False)
        self.A, self.B = nn.Linear(k, r, bias=False), nn.Linear(r, k, bias=False)
        nn.init.normal_(self.B.weight)
        self.head = nn.Linear(k, classes)

    def forward(self, x):  # x: (b, t, k) or (b, k)
        for _ in range(2):
            x = torch.tanh(self.W(x) + 0.5 * self.B(self.A(x)))
        return self.head(x.mean(1) if x.ndim == 3 else x)


def _losses(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="none")


def _tapped(model, x, y):
    """The trainable tensors, the taps, their owners, and autograd's gradients of the summed loss: the tensors' and
    then the taps' outputs'."""
    params = [p for p in model.parameters() if p.requires_grad]
    owners, why = linear_owners(model, params)
    assert owners is not None, why
    with LinearTaps([m for m, _ in owners]) as taps:
        losses = _losses(model, x, y)
    grads = torch.autograd.grad(losses.sum(), params + taps.outputs(), allow_unused=True)
    return params, taps, owners, grads


def _taps_grads(model, x, y):
    params, taps, owners, grads = _tapped(model, x, y)
    return params, per_example_grads(taps, owners, grads[len(params) :], len(x)), grads[: len(params)]


def _model_and_batch(b: int, t: int, k: int, r: int, classes: int, seed: int):
    """A LoRA stack and a batch of b records (of t tokens, or single vectors at t = 0) with their labels."""
    model = LoraStack(k, r, classes, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((b, t, k) if t else (b, k), generator=g)
    return model, x, torch.randint(0, classes, (b,), generator=g)


@st.composite
def problems(draw):
    b, t, k, r = draw(st.integers(1, 6)), draw(st.integers(0, 5)), draw(st.integers(2, 9)), draw(st.integers(1, 4))
    return b, t, k, r, draw(st.integers(2, 4)), draw(st.integers(0, 2**31 - 1)), draw(st.floats(1e-3, 10.0))


@SETTINGS
@given(problems())
def test_per_example_gradients_equal_autograd_on_each_record_alone(problem):
    b, t, k, r, classes, seed, C = problem
    model, x, y = _model_and_batch(b, t, k, r, classes, seed)
    params, per_example, _ = _taps_grads(model, x, y)
    total = None
    for j in range(b):  # the independent computation: one record, one backward
        alone = torch.autograd.grad(_losses(model, x[j : j + 1], y[j : j + 1]).sum(), params)
        for pe, a in zip(per_example, alone):
            torch.testing.assert_close(pe[j], a, rtol=1e-4, atol=1e-6)
        total, _ = add_clipped(total, alone, C)
    clipped, scales = clipped_sum(per_example, C)
    assert len(scales) == b and all(0 < c <= 1 for c in scales)
    for c, ref in zip(clipped, total):
        torch.testing.assert_close(c, ref, rtol=1e-4, atol=1e-6)


def test_the_sum_check_finds_a_weight_read_outside_its_forward():
    class Merged(LoraStack):  # B A read directly, as a merged-weight variant would: the taps never see it
        def forward(self, x):
            return self.head(torch.tanh(x @ (self.W.weight + self.B.weight @ self.A.weight).T))

    model = Merged(5, 2, 3, 0)
    x, y = torch.randn(4, 5), torch.tensor([0, 1, 2, 0])
    _, per_example, grads = _taps_grads(model, x, y)
    assert "tensor 0" in check_sum(per_example, grads, rtol=1e-3)  # A: the taps saw no call
    model = LoraStack(5, 2, 3, 0)
    _, per_example, grads = _taps_grads(model, x, y)
    assert check_sum(per_example, grads, rtol=1e-3) == ""


def test_owners_refuse_what_taps_cannot_split():
    model = LoraStack(4, 2, 2, 0)
    model.norm = nn.BatchNorm1d(4)
    owners, why = linear_owners(model, [model.A.weight])
    assert owners is None and "norm (BatchNorm1d) mixes the records" in why
    model = LoraStack(4, 2, 2, 0)
    model.scale = nn.Parameter(torch.ones(4))
    owners, why = linear_owners(model, [model.A.weight, model.scale])
    assert owners is None and "trainable tensor scale is not the weight or bias of a plain nn.Linear" in why


def test_a_module_fed_flattened_records_is_not_split():
    lin = nn.Linear(3, 2)
    with LinearTaps([lin]) as taps:
        out = lin(torch.randn(4, 5, 3).reshape(20, 3))  # b = 4 records flattened to 20 rows
    (g,) = torch.autograd.grad(out.sum(), taps.outputs())
    assert per_example_grads(taps, [(lin, "weight")], [g], 4) is None


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_taps_record_only_forwards_with_gradients(grad_enabled):
    lin = nn.Linear(3, 2)
    with LinearTaps([lin]) as taps, torch.set_grad_enabled(grad_enabled):
        lin(torch.randn(2, 3))
    lin(torch.randn(2, 3))  # after the block: no hook left
    assert len(taps.calls[lin]) == int(grad_enabled)


# ------------------------------------------------------------------------------------------ non-finite records
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_record_with_a_non_finite_gradient_contributes_zero(bad):
    """One record's gradient overflows (an fp16 step without a loss scaler, say): the clipped sum is the sum over the
    other records, bit for bit, whether it comes batched (clipped_sum) or record by record (add_clipped), so the step
    is that batch without the record plus the same noise. Before, 0 * inf (or C / NaN) made the whole sum NaN, and
    the client's restart then told the server about that one record."""
    torch.manual_seed(0)
    grads = [torch.randn(5, 3, 4), torch.randn(5, 7)]  # per-example, 5 records
    grads[0][2, 1, 1] = bad
    others = [g[[0, 1, 3, 4]] for g in grads]
    total, scales = clipped_sum(grads, C=1.0)
    want, want_scales = clipped_sum(others, C=1.0)
    assert scales[2] == 0.0 and [s for j, s in enumerate(scales) if j != 2] == want_scales
    for t, w in zip(total, want):
        assert torch.isfinite(t).all() and torch.equal(t, w)
    running = None
    for j in range(5):
        running, c = add_clipped(running, [g[j] for g in grads], C=1.0)
        assert (c == 0.0) == (j == 2)
    for t, w in zip(running, want):
        assert torch.allclose(t, w, rtol=0, atol=1e-12)
    noise = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert torch.equal(total[0] + noise, want[0] + noise)


def test_a_non_finite_client_update_is_left_out_of_the_client_level_release():
    """Client level: an upload whose norm is not finite gets c = 0 and is left out of the noisy mean, which stays
    finite and equals the release without it (the same noise, K unchanged)."""
    from fs_fedpa.privacy.mechanism import dp_generator, release_products

    torch.manual_seed(2)
    good = {"m": (torch.randn(6, 2), torch.randn(2, 5))}
    bad = {"m": (torch.full((6, 2), float("inf")), torch.randn(2, 5))}
    with_bad, scales = release_products([good, bad], {"m": (6, 5)}, K=2, C=1.0, z=1.0, generator=dp_generator(3))
    alone, _ = release_products([good], {"m": (6, 5)}, K=2, C=1.0, z=1.0, generator=dp_generator(3))
    assert scales[1] == 0.0 and torch.isfinite(with_bad["m"]).all() and torch.equal(with_bad["m"], alone["m"])


# ------------------------------------------------------------------------------------------ what the sum check misses
class SequenceFirst(nn.Module):
    """A transformer layer built sequence-first (torch's default) with a trainable head; input (b, t, k)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=8, dropout=0.0)
        self.layer.requires_grad_(False)
        self.layer.linear1.requires_grad_(True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.layer(x.transpose(0, 1)).mean(0))


def test_the_sum_check_cannot_see_a_sequence_first_layer_so_it_is_refused():
    """With t == b the taps split linear1's (t, b, k) input along t: the per-record gradients are wrong, yet they sum
    to autograd's gradient, so check_sum passes. linear_owners refuses such a module, and DP-SGD takes its loop."""
    model, b = SequenceFirst(), 4
    x, y = torch.randn(b, b, 8), torch.tensor([0, 1, 0, 1])
    params = [model.layer.linear1.weight]
    with LinearTaps([model.layer.linear1]) as taps:
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    grads = torch.autograd.grad(losses.sum(), [*params, *taps.outputs()])
    owners = [(model.layer.linear1, "weight")]
    found = per_example_grads(taps, owners, grads[1:], b)
    assert check_sum(found, grads[:1], rtol=1e-4) == ""  # the sum agrees ...
    own = torch.autograd.grad(nn.functional.cross_entropy(model(x[:1]), y[:1]), params)[0]
    assert not torch.allclose(found[0][0], own, atol=1e-4)  # ... record 0's own gradient does not
    owners, why = linear_owners(model, params)
    assert owners is None and "batch_first=False" in why
    model.layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=8, dropout=0.0, batch_first=True)
    assert linear_owners(model, [model.layer.linear1.weight])[0] is not None  # batch-first: accepted


# ---------------------------------------------------------------------------------------- the flat forms DP-SGD takes
def _flat_problem(b: int, shapes: list[tuple[int, ...]], seed: int, bad: int | None = None):
    g = torch.Generator().manual_seed(seed)
    per = [torch.randn(b, *s, generator=g) * float(torch.rand(1, generator=g) * 3) for s in shapes]
    if bad is not None and b:
        per[0].view(b, -1)[bad % b, 0] = float("nan") if bad % 2 else float("inf")
    return per


@SETTINGS
@given(problems())
def test_the_per_example_matrix_is_the_per_example_gradients_side_by_side(problem):
    b, t, k, r, classes, seed, _ = problem
    model, x, y = _model_and_batch(b, t, k, r, classes, seed)
    params, taps, owners, grads = _tapped(model, x, y)
    matrix = per_example_matrix(taps, owners, grads[len(params) :], b)
    apart = per_example_grads(taps, owners, grads[len(params) :], b)
    assert matrix.shape == (b, sum(p.numel() for p in params)) and matrix.dtype == torch.float32
    assert torch.equal(matrix, torch.cat([pe.flatten(1) for pe in apart], 1))


@SETTINGS
@given(st.integers(1, 6), st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=2), min_size=1, max_size=6),
       st.integers(0, 2**31 - 1), st.floats(1e-3, 10.0), st.one_of(st.none(), st.integers(0, 11)))  # fmt: skip
def test_the_flat_clip_is_the_per_record_clip(b, shapes, seed, C, bad):
    """clipped_sum_flat on the (b, P) matrix against add_clipped record by record (an independent computation, one
    record's tensors at a time): the same sum in float64, c_j = clip_scale of each record's joint norm, and a record
    whose norm is not finite gets c_j = 0 and contributes nothing."""
    from fs_fedpa.privacy.mechanism import clip_scale

    per = _flat_problem(b, [tuple(s) for s in shapes], seed, bad)
    total, c = clipped_sum_flat(torch.cat([pe.reshape(b, -1) for pe in per], 1), C)
    running = None
    for j in range(b):
        sq = sum(float(pe[j].double().pow(2).sum()) for pe in per)
        assert float(c[j]) == pytest.approx(clip_scale(sq, C), rel=1e-12, abs=0)
        running, cj = add_clipped(running, [pe[j] for pe in per], C)
        assert (cj == 0.0) == (float(c[j]) == 0.0) == (bad is not None and j == bad % b)
    assert total.dtype == torch.float64 and bool(torch.isfinite(total).all())
    torch.testing.assert_close(total, torch.cat([t.flatten() for t in running]), rtol=1e-12, atol=1e-12)
    norm = float((total / max(1, b)).norm())
    assert norm <= C * (1 + 1e-9)  # each record's contribution is within C: the mean is too


@SETTINGS
@given(st.integers(1, 5), st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=2), min_size=1, max_size=6),
       st.integers(0, 2**31 - 1), st.sets(st.integers(0, 5)), st.sets(st.integers(0, 5)))  # fmt: skip
def test_the_flat_sum_check_is_the_per_tensor_check(b, shapes, seed, unreached, off):
    """sum_gaps against the per-tensor norms in float64 (tensors autograd did not reach, None, count as 0), and
    sum_mismatch against describe_gaps and the per-tensor rule |sum - gradient| <= rtol |gradient| + 1e-12."""
    per = _flat_problem(b, [tuple(s) for s in shapes], seed)
    grads = [None if i in unreached else pe.sum(0) * (1.1 if i in off else 1.0) for i, pe in enumerate(per)]
    sizes = [pe[0].numel() for pe in per]
    gaps = sum_gaps(torch.cat([pe.reshape(b, -1) for pe in per], 1), grads, sizes)
    want = []
    for pe, gr in zip(per, grads):
        ref = torch.zeros(pe.shape[1:], dtype=torch.float64) if gr is None else gr.double()
        want.append([float((pe.sum(0).double() - ref).norm()), float(ref.norm())])
    # the float32 sums over the records are the same up to their order (a matrix's columns, a tensor alone)
    torch.testing.assert_close(gaps.T, torch.tensor(want, dtype=torch.float64).reshape(-1, 2), rtol=1e-6, atol=1e-5)
    for rtol in (1e-3, 0.5):
        rule = [i for i, (gap, scale) in enumerate(gaps.T.tolist()) if not gap <= rtol * scale + 1e-12]
        assert rule == [i for i, (gap, scale) in enumerate(want) if not gap <= rtol * scale + 1e-12]
        message = describe_gaps(gaps, rtol)
        assert bool(sum_mismatch(gaps, rtol)) == bool(rule) == bool(message)
        assert check_sum(per, grads, rtol) == message
        if rule:
            assert message.startswith(f"tensor {rule[0]}:")


def test_the_flat_check_and_clip_take_as_many_operations_for_3_tensors_as_for_30_and_read_nothing_back():
    """What DP-SGD does per chunk after the per-example gradients is a fixed number of torch operations that compute
    (each a kernel launch on an accelerator; views of the gradients aside), whatever the number of tensors, and no
    host read (no device sync): the chunk's one read of its flags is the caller's."""
    from torch.profiler import ProfilerActivity, profile

    views = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::select"}

    def ops(n_tensors):
        per = _flat_problem(4, [(3, 2)] * n_tensors, 0)
        matrix = torch.cat([pe.reshape(4, -1) for pe in per], 1)
        grads = [pe.sum(0) for pe in per]
        sizes = [6] * n_tensors
        sum_gaps(matrix, grads, sizes)  # the segment index, cached
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sum_mismatch(sum_gaps(matrix, grads, sizes), 1e-3)
            clipped_sum_flat(matrix, 1.0)
        names = [e.name for e in prof.events() if e.name.startswith("aten::") and e.name not in views]
        return len(names), names.count("aten::_local_scalar_dense") + names.count("aten::item")

    assert ops(3) == ops(30) and ops(3)[1] == 0
