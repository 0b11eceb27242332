"""Round diagnostics from factors only (§3.3): E_agg, E_init and the aggregate's spectrum.

Nothing here forms a ``(d, k)`` matrix: a Frobenius norm of a product is taken as
``||B A||_F = ||R_B A||_F`` with ``B = Q_B R_B`` a reduced QR, which costs ``O(d r^2 + r^2 k)``
and, unlike the Gram expansion ``tr(B^T B A A^T)``, does not lose half the digits to
cancellation when the product is small next to its factors (E_agg of an exact
reconstruction is ~0).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from fs_fedpa.core._checks import check_factor_lists, check_finite, compute_dtype, normalized_weights
from fs_fedpa.core.norms import factored_norm


def aggregation_error(
    Bs: Sequence[Tensor],
    As: Sequence[Tensor],
    B_g: Tensor,
    A_g: Tensor,
    weights: Sequence[float] | Tensor | None = None,
    relative: bool = False,
) -> Tensor:
    """E_agg = ``||B_g A_g - sum_i w_i B_i A_i||_F`` (§3.3, Eq. aggregation error).

    Holds for any global factors: FedPA's reconstruction, FedIT's averaged factors, FlexLoRA's
    SVD. The difference is itself a product, ``[B_cat, -B_g] [A_cat; A_g]``, so its norm is a
    :func:`factored_norm` of rank ``r_tot + R_g``.

    Args:
        Bs, As: client factors ``(*, d, r_i)``, ``(*, r_i, k)``; ``weights`` as in ``reconstruct``
            (default uniform, the paper's 1/N).
        B_g, A_g: global factors ``(*, d, R)``, ``(*, R, k)``.
        relative: divide by ``||sum_i w_i B_i A_i||_F`` (0 stays 0).

    Returns: ``(*)`` tensor in float32 (float64 for float64 inputs).
    """
    check_factor_lists([*Bs, B_g], [*As, A_g])
    B_cat, A_cat = _weighted_cat(Bs, As, weights, compute_dtype(B_g.dtype))
    err = factored_norm(
        torch.cat([B_cat, -B_g.to(B_cat.dtype)], dim=-1), torch.cat([A_cat, A_g.to(A_cat.dtype)], dim=-2)
    )
    if not relative:
        return err
    ideal = factored_norm(B_cat, A_cat)
    return torch.where(ideal > 0, err / ideal.clamp_min(torch.finfo(ideal.dtype).tiny), torch.zeros_like(err))


def aggregate_norm(
    Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Sequence[float] | Tensor | None = None
) -> Tensor:
    """``||sum_i w_i B_i A_i||_F`` from the factors: the scale E_agg is relative to."""
    _, dtype, _ = check_factor_lists(Bs, As)
    return factored_norm(*_weighted_cat(Bs, As, weights, compute_dtype(dtype)))


def _weighted_cat(Bs, As, weights, cdtype) -> tuple[Tensor, Tensor]:
    """``B_cat = [sqrt(w_i) B_i]``, ``A_cat = [sqrt(w_i) A_i]`` so that ``B_cat A_cat = sum_i w_i B_i A_i``."""
    from fs_fedpa.core.reconstruct import weighted_stack

    B_cat, A_cat = weighted_stack(Bs, As, normalized_weights(weights, len(Bs)), cdtype)
    check_finite(B_cat, "client B factors")
    check_finite(A_cat, "client A factors")
    return B_cat, A_cat


def initialization_error(starts: Sequence[Tensor], ends: Sequence[Tensor], eps: float = 1e-8) -> float:
    """Relative factor-level initialisation error (§3.3, Eq. initialization error).

    ``E_init(Y) = 1/N sum_i ||Y_i^(t+1,0) - Y_i^(t)||_F / (||Y_i^(t+1,0)||_F + eps)`` for one factor
    kind Y in {B, A}: ``starts[i]`` is client i's factor at the start of round t+1, ``ends[i]``
    the one it had at the end of round t. Zero for FedPA-LoRA, which keeps its factors.
    """
    if len(starts) == 0 or len(starts) != len(ends):
        raise ValueError(f"need one start and one end per client, got {len(starts)} and {len(ends)}")
    if eps <= 0:
        raise ValueError(f"eps(={eps}) must be > 0")
    total = 0.0
    for i, (start, end) in enumerate(zip(starts, ends)):
        if start.shape != end.shape:
            raise ValueError(f"client {i}: start {tuple(start.shape)} and end {tuple(end.shape)} differ in shape")
        cdtype = compute_dtype(start.dtype)
        s, e = start.to(cdtype), end.to(cdtype)
        total += float(torch.linalg.vector_norm(s - e) / (torch.linalg.vector_norm(s) + eps))
    return total / len(starts)


def aggregate_spectrum(
    Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Sequence[float] | Tensor | None = None
) -> Tensor:
    """Singular values ``(*, min(d, k, r_tot))`` of ``sum_i w_i B_i A_i``, descending, from its QR core.

    :func:`fs_fedpa.reconstruct` with ``return_spectrum=True`` gives the same values for free
    during aggregation; this is the stand-alone form.
    """
    from fs_fedpa.core.reconstruct import reconstruct

    _, _, S = reconstruct(Bs, As, rank=1, weights=weights, mode="reduced", return_spectrum=True)
    return S


class GradientSplit:
    """The norms of the two parts of the gradient on a client's factors, from the backward pass training runs.

    The alignment term reads every factor through :meth:`alias` (a view whose hook sees only the gradient of
    that term); the factor's own hook, installed by :meth:`watch`, sees the whole gradient. The task part is the
    difference. No extra forward or backward, no ``(d, k)`` tensor, no host sync per step: per step two squared
    norms of ``(d, r)`` and ``(r, k)`` tensors, kept on the factors' device. :meth:`norms` gives
    ``(||g_align||, ||g_task||)`` over all factors of the round's first and last step.
    """

    def __init__(self) -> None:
        self._handles: list = []
        self._align: dict[int, Tensor] = {}
        self._step: list[Tensor] | None = None  # [align_sq, task_sq] of the step in progress
        self._first: list[Tensor] | None = None
        self._last: list[Tensor] | None = None

    def watch(self, factors: dict[str, tuple[Tensor, Tensor]]) -> None:
        """Start a round: hook every trainable factor (live parameters)."""
        self.close()
        self._first = self._last = None
        for pair in factors.values():
            for p in pair:
                if p.requires_grad:
                    self._handles.append(p.register_hook(functools.partial(self._total, id(p))))

    def alias(self, factors: dict[str, tuple[Tensor, Tensor]]) -> dict[str, tuple[Tensor, Tensor]]:
        """Views of ``factors`` to compute the alignment term from; their gradients are the term's part."""
        return {n: (self._view(B), self._view(A)) for n, (B, A) in factors.items()}

    def add_alignment(self, sq: Tensor) -> None:
        """The step's squared norm of the term's gradient where it is not seen by autograd (a term that adds its
        gradient in closed form, :class:`~fs_fedpa.core.batched_penalty.ProductTerm`); the factors' hooks then see
        the task's part alone."""
        if self._step is None:
            self._step = [sq.new_zeros(()), sq.new_zeros(())]
        self._step[0] = self._step[0] + sq.detach().float()

    def end_step(self) -> None:
        """Close the step whose backward ran last (call before the next step's forward and at the round's end)."""
        if self._step is not None:
            self._first = self._first or self._step
            self._last = self._step
        self.discard()

    def discard(self) -> None:
        """Forget gradients seen since the last :meth:`end_step` (e.g. the adaptive-lambda probe's autograd.grad)."""
        self._step, self._align = None, {}

    def close(self) -> None:
        """End the round: close the last step and remove the hooks."""
        self.end_step()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def norms(self) -> dict[str, tuple[float, float]]:
        """``{"first": (||g_align||, ||g_task||), "last": ...}`` of the round's steps (empty before a backward)."""
        return {
            key: (float(step[0]) ** 0.5, float(step[1]) ** 0.5)
            for key, step in (("first", self._first), ("last", self._last))
            if step is not None
        }

    def _view(self, p: Tensor) -> Tensor:
        if not p.requires_grad:
            return p
        v = p.view_as(p)
        v.register_hook(functools.partial(self._remember, id(p)))
        return v

    def _remember(self, key: int, g: Tensor) -> None:
        g = g.detach().float()
        self._align[key] = g + self._align[key] if key in self._align else g

    def _total(self, key: int, g: Tensor) -> None:
        g = g.detach().float()
        align = self._align.pop(key, None)
        if self._step is None:
            self._step = [g.new_zeros(()), g.new_zeros(())]
        if align is None:
            self._step[1] = self._step[1] + g.square().sum()
        else:
            self._step[0] = self._step[0] + align.square().sum()
            self._step[1] = self._step[1] + (g - align).square().sum()
