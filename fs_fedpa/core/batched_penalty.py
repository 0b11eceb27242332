"""The product penalty of §4.2 over every LoRA module of a client at once, for training.

    T = c * sum_m ||B_m A_m - B_r,m A_r,m||_F^2                  (c = lam/2 times the client's weight)
    dT/dB = 2c (B (A A^T) - B_r (A A_r^T)^T),  dT/dA = 2c ((B^T B) A - (B^T B_r) A_r)

:func:`fs_fedpa.core.penalty.product_penalty` computes one module's term through autograd: about 160 operator calls
a module and step, each a kernel launch on a GPU. :class:`ProductTerm` stacks the modules of one shape (d, k, r, R,
dtype, device) into a group whose factors share one ``(n, d, r)`` / ``(n, r, k)`` storage with the live parameters
(no copy a step), computes the term's value from the four Grams of the group (a few batched products), and at the end
of the backward pass adds the gradient above, in closed form, to the factors' task gradients stacked into one buffer
a factor kind, whose rows become their ``.grad``: a fixed number of operator calls a group (about 60), whatever the
number of modules. The value it returns to the
loss is the Gram expansion (as :func:`product_penalty`'s); :meth:`ProductTerm.value` gives the accurate one, from
QR factors, for the records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from fs_fedpa.core._checks import compute_dtype
from fs_fedpa.core.norms import product_distance

Pairs = Mapping[str, tuple[Tensor, Tensor]]


class _Group:
    """The modules of one shape: their live factors re-pointed into the stacks ``B: (n, d, r)``, ``A: (n, r, k)``
    (each parameter a view of its row), the references ``B_r: (n, d, R)``, ``A_r: (n, R, k)`` in the compute dtype,
    the constant ``<B_r^T B_r, A_r A_r^T>`` of each module, and a gradient buffer per factor kind whose rows become
    the parameters' ``.grad``."""

    def __init__(self, Bs: list[Tensor], As: list[Tensor], refs: list[tuple[Tensor, Tensor]]):
        self.Bs, self.As = Bs, As
        self.cdtype = compute_dtype(Bs[0].dtype)
        with torch.no_grad():
            self.B_r = torch.stack([B.detach() for B, _ in refs]).to(self.cdtype)
            self.A_r = torch.stack([A.detach() for _, A in refs]).to(self.cdtype)
            self.A_rT = self.A_r.mT
            self.const = (torch.bmm(self.B_r.mT, self.B_r) * torch.bmm(self.A_r, self.A_r.mT)).sum((-2, -1))
        self.stack()
        self.saved: tuple[Tensor, ...] = ()

    def stack(self) -> None:
        """The parameters' values into one storage per factor kind, each parameter a view of its row."""
        with torch.no_grad():
            self.B = torch.stack([B.detach() for B in self.Bs])
            self.A = torch.stack([A.detach() for A in self.As])
        for p, row in zip(self.Bs, self.B.unbind(0)):
            p.data = row
        for p, row in zip(self.As, self.A.unbind(0)):
            p.data = row
        self.Bt, self.At = self.B.mT, self.A.mT
        self.pointers = [p.data_ptr() for p in (*self.Bs, *self.As)]
        self.gB, self.gA = torch.empty_like(self.B), torch.empty_like(self.A)
        self.gB_rows, self.gA_rows = list(self.gB.unbind(0)), list(self.gA.unbind(0))
        # the buffers as (n d, r) and (n r, k): the factors' gradients concatenate into them in one call
        self.gB_cat, self.gA_cat = self.gB.view(-1, self.gB.shape[-1]), self.gA.view(-1, self.gA.shape[-1])

    def check(self) -> None:
        """Stack again where something replaced a parameter's storage since (e.g. a move to another device)."""
        if [p.data_ptr() for p in (*self.Bs, *self.As)] != self.pointers:
            self.stack()

    def release(self) -> None:
        """Each parameter back on a storage of its own."""
        for p in (*self.Bs, *self.As):
            p.data = p.data.clone()

    def forward(self) -> Tensor:
        """``(n,)``: each module's ``||B A - B_r A_r||_F^2`` by the Gram expansion (clamped at 0, as
        :func:`~fs_fedpa.core.penalty.product_penalty`); the Grams are kept for the gradient."""
        if self.cdtype == self.B.dtype == self.A.dtype:
            B, A, Bt, At = self.B, self.A, self.Bt, self.At  # transposed views made once a round
        else:
            B, A = self.B.to(self.cdtype), self.A.to(self.cdtype)
            Bt, At = B.mT, A.mT
        AAt, AArt = torch.bmm(A, At), torch.bmm(A, self.A_rT)  # (n, r, r), (n, r, R)
        BtB, BtBr = torch.bmm(Bt, B), torch.bmm(Bt, self.B_r)
        self.saved = (B, A, AAt, AArt, BtB, BtBr)
        own, cross = (BtB * AAt).sum((-2, -1)), (BtBr * AArt).sum((-2, -1))
        return torch.sub(own, cross, alpha=2).add_(self.const).clamp_min_(0)

    def add_grads(self, grad_out: Tensor, coef: float, on_alignment_sq: Callable[[Tensor], None] | None) -> None:
        """Add ``grad_out`` times the term's gradient, ``2 coef (B (A A^T) - B_r (A A_r^T)^T, (B^T B) A -
        (B^T B_r) A_r)``, to the factors' ``.grad``.

        The usual step (every factor has its task gradient): the gradients are stacked into the group's buffer, the
        term's added in one call, and each factor's ``.grad`` becomes its row of the buffer (already is, when the
        gradients were not reset since the last step), so that the calls do not grow with the modules."""
        B, A, AAt, AArt, BtB, BtBr = self.saved
        self.saved = ()
        # grad_out scales the (r, r) and (r, R) Grams, not the (n, d, r) gradient: the gradient is X Y - L R
        kinds = ((self.Bs, self.gB, self.gB_cat, self.gB_rows, B, AAt * grad_out, self.B_r, AArt.mT * grad_out),
                 (self.As, self.gA, self.gA_cat, self.gA_rows, BtB * grad_out, A, BtBr * grad_out, self.A_r))  # fmt: skip
        sq = None
        for params, buffer, flat, rows, X, Y, L, R in kinds:
            grads = [p.grad for p in params]
            usual = all(p.requires_grad for p in params) and all(x is not None for x in grads)
            in_place = usual and buffer.dtype == X.dtype  # whatever the diagnostics: they must not move a bit
            g = None
            if on_alignment_sq is not None or not in_place:
                g = torch.baddbmm(torch.bmm(X, Y), L, R, beta=2 * coef, alpha=-2 * coef)
                if on_alignment_sq is not None:
                    sq = g.square().sum() if sq is None else sq + g.square().sum()
            if usual:
                held = [x is row for x, row in zip(grads, rows)]  # rows left from the last step (not reset)
                if not any(held):
                    torch.cat(grads, out=flat)
                elif not all(held):
                    for x, row, kept in zip(grads, rows, held):
                        if not kept:
                            row.copy_(x)
                if in_place:  # no (n, d, r) temporary
                    buffer.baddbmm_(X, Y, alpha=2 * coef).baddbmm_(L, R, alpha=-2 * coef)
                else:
                    buffer.add_(g)
                for p, row in zip(params, rows):
                    if p.grad is not row:
                        p.grad = row
            elif all(x is None for x in grads):  # nothing accumulated (DP-SGD's data-free backward): rows of g
                for p, row in zip(params, _as(g, params[0].dtype).unbind(0)):
                    if p.requires_grad:
                        p.grad = row
            else:
                for p, row in zip(params, g.unbind(0)):
                    if p.requires_grad:
                        p.grad = row.to(p.dtype) if p.grad is None else p.grad.add_(row)
        if on_alignment_sq is not None:
            on_alignment_sq(sq)


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x if x.dtype == dtype else x.to(dtype)


class _Attach(torch.autograd.Function):
    """The term's value as a differentiable scalar whose backward returns no gradient but queues the closed-form
    one for the end of the backward pass, which adds it straight to ``.grad``."""

    @staticmethod
    def forward(ctx, anchor: Tensor, term: ProductTerm, coef: float) -> Tensor:
        ctx.term, ctx.coef = term, coef
        parts = [group.forward().sum() for group in term.groups]
        total = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
        return torch.add(term.zero, total, alpha=coef)  # coef * total without a Python number made a tensor

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        term, coef = ctx.term, ctx.coef  # grad_out: 1, a GradScaler's scale, 1/accumulation steps
        torch.autograd.Variable._execution_engine.queue_callback(lambda: term.add_grads(grad_out, coef))
        return None, None, None


class ProductTerm:
    """One client's product penalty for a round: ``live`` its trainable factors ``{name: (B (d, r), A (r, k))}``
    (parameters; they are re-pointed into per-shape stacks until :meth:`release`), ``reference`` the round's
    ``{name: (B_r (d, R), A_r (R, k))}`` (constants), on the parameters' device. ``on_alignment_sq`` (optional)
    is given, each step and shape group, the squared norm of the term's gradient on the group's factors as a tensor
    (the gradient-split diagnostic)."""

    def __init__(self, live: Pairs, reference: Pairs, on_alignment_sq: Callable[[Tensor], None] | None = None):
        members: dict[tuple, list[str]] = {}
        for name, (B, A) in live.items():
            B_r, A_r = reference[name]
            if B.shape[-2] != B_r.shape[-2] or A.shape[-1] != A_r.shape[-1] or B.shape[-1] != A.shape[-2]:
                raise ValueError(f"{name}: factors B {tuple(B.shape)}, A {tuple(A.shape)} and reference "
                                 f"B_r {tuple(B_r.shape)}, A_r {tuple(A_r.shape)} do not make two d x k products")
            key = (tuple(B.shape), tuple(A.shape), B_r.shape[-1], B.dtype, A.dtype, B.device)
            members.setdefault(key, []).append(name)
        self.groups = [_Group([live[n][0] for n in names], [live[n][1] for n in names], [reference[n] for n in names])
                       for names in members.values()]  # fmt: skip
        self.on_alignment_sq = on_alignment_sq
        first = next(iter(live.values()))[0]
        self._anchor = torch.zeros((), device=first.device, requires_grad=True)
        self.zero = torch.zeros((), device=first.device, dtype=self.groups[0].cdtype)

    def __call__(self, coef: float) -> Tensor:
        """``coef * sum_m ||B_m A_m - B_r,m A_r,m||_F^2`` as a scalar to add to the loss; its backward adds the
        gradient to the factors' ``.grad`` when the backward pass ends."""
        with torch.autocast(self._anchor.device.type, enabled=False):
            for group in self.groups:
                group.check()
            return _Attach.apply(self._anchor, self, coef)

    def add_grads(self, grad_out: Tensor, coef: float) -> None:
        with torch.no_grad(), torch.autocast(self._anchor.device.type, enabled=False):
            for group in self.groups:
                group.add_grads(grad_out, coef, self.on_alignment_sq)

    def value(self, coef: float) -> float:
        """``coef * sum_m ||B_m A_m - B_r,m A_r,m||_F^2`` now, accurately: the norms from QR factors in float64
        (:func:`~fs_fedpa.core.norms.product_distance`), which the Gram expansion loses to cancellation when the
        products agree."""
        with torch.no_grad():
            total = sum(float(product_distance(g.B.double(), g.A.double(), g.B_r.double(), g.A_r.double())
                              .square().sum()) for g in self.groups)  # fmt: skip
        return coef * total

    def release(self) -> None:
        """Every parameter back on a storage of its own; the term is not used after."""
        for group in self.groups:
            group.release()
        self.groups = []
