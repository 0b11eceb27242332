"""Per-example gradients of ``nn.Linear`` weights from a batched forward and backward (hooks like Opacus's, in plain
torch), for DP-SGD's clipping (:mod:`fs_fedpa.plugin.dp_sgd`).

A linear map ``y = x W^T + b`` applied to a batch ``x`` of shape ``(b, ..., in)`` gives, for ``L = sum_j L_j`` where
record j's loss reads row j alone, ``dL_j/dW = sum_t g_jt^T x_jt`` of shape ``(out, in)`` and ``dL_j/db = sum_t
g_jt``, with ``g = dL/dy`` of shape ``(b, ..., out)`` from one backward of L. So a batch needs one forward and one
backward instead of b of each. It holds when no module mixes records (batch normalization does, and is refused) and
every trainable tensor is the weight or bias of a plain ``nn.Linear`` used only through its forward: LoRA's A and B
in PEFT, and a classifier head. :func:`check_sum` verifies the second condition on every batch against autograd's
gradient of L. It cannot verify the first: a module that mixes records, or a layer fed sequence-first (records along
dimension 1), leaves the *sum* of the per-example gradients equal to the batch's gradient while each record's own
is wrong, so the clip would bound the wrong quantities. :func:`linear_owners` therefore refuses the modules known to
do either (batch normalization; attention, recurrent and transformer layers built with ``batch_first=False``), and
DP-SGD then takes its per-example loop, which is exact for any model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

# torch modules whose default layout puts the sequence first: with batch_first=False they and the layers around them
# (torch's transformer layers pass the flag to their attention) see (sequence, batch, features), so a tap would take
# the sequence for the records (and check_sum could not tell)
SEQUENCE_FIRST = (nn.MultiheadAttention, nn.RNNBase)


def linear_owners(model: nn.Module, params: Sequence[Tensor]) -> tuple[list[tuple[nn.Linear, str]] | None, str]:
    """For each tensor of ``params``, the plain ``nn.Linear`` holding it and ``"weight"`` or ``"bias"``; or None and
    the reason when one is held by anything else, or ``model`` holds a module that mixes records."""
    held = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return None, f"module {name} ({type(m).__name__}) mixes the records of a batch"
        if isinstance(m, SEQUENCE_FIRST) and not getattr(m, "batch_first", False):
            return None, (
                f"module {name} ({type(m).__name__}) is sequence-first (batch_first=False): the linear layers in it "
                "see the records along dimension 1, which the taps would split as records"
            )
        if type(m) is nn.Linear:
            for role in ("weight", "bias"):
                p = getattr(m, role)
                if p is not None:
                    held[id(p)] = (m, role)
    owners = []
    names = {id(p): n for n, p in model.named_parameters()}
    for p in params:
        if id(p) not in held:
            return None, f"trainable tensor {names.get(id(p), '?')} is not the weight or bias of a plain nn.Linear"
        owners.append(held[id(p)])
    return owners, ""


class LinearTaps:
    """Within ``with``: every forward of the given modules made with gradients on records its input and output;
    ``calls[m]`` is the list of ``(x, y)`` for module m."""

    def __init__(self, modules: Sequence[nn.Module]):
        self.modules = list(dict.fromkeys(modules))
        self.calls: dict[nn.Module, list[tuple[Tensor, Tensor]]] = {m: [] for m in self.modules}
        self._handles = []

    def _tap(self, module, inputs, output):
        if torch.is_grad_enabled() and output.requires_grad:
            self.calls[module].append((inputs[0].detach(), output))

    def __enter__(self) -> LinearTaps:
        self._handles = [m.register_forward_hook(self._tap) for m in self.modules]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def outputs(self) -> list[Tensor]:
        """Every recorded output, module by module, in call order (what :func:`per_example_grads` pairs with)."""
        return [y for m in self.modules for _, y in self.calls[m]]


def _module_grads(taps: LinearTaps, owners: Sequence[tuple[nn.Linear, str]], output_grads: Sequence[Tensor | None],
                  b: int) -> dict[nn.Module, dict[str, Tensor]] | None:  # fmt: skip
    """Per tapped module, ``{"weight": (b, out, in), "bias": (b, out)}`` float32 for the roles ``owners`` name
    (summed over the module's calls); None when a call's leading dimension is not ``b``."""
    wanted: dict[nn.Module, set[str]] = {}
    for m, role in owners:
        wanted.setdefault(m, set()).add(role)
    grads_of: dict[nn.Module, dict[str, Tensor]] = {}
    k = 0
    for m in taps.modules:
        acc: dict[str, Tensor] = {}
        roles = wanted.get(m, ())
        for x, _ in taps.calls[m]:
            g = output_grads[k]
            k += 1
            if g is None:
                continue
            if x.shape[0] != b or g.shape[0] != b:
                return None
            g3 = g.reshape(b, -1, g.shape[-1])
            g3 = g3 if g3.dtype == torch.float32 else g3.float()
            if "weight" in roles:
                x3 = x.reshape(b, -1, x.shape[-1])
                t = torch.bmm(g3.transpose(1, 2), x3 if x3.dtype == torch.float32 else x3.float())
                acc["weight"] = t if "weight" not in acc else acc["weight"].add_(t)  # acc's own tensor
            if "bias" in roles:
                t = g3.sum(1)
                acc["bias"] = t if "bias" not in acc else acc["bias"].add_(t)
        grads_of[m] = acc
    return grads_of


def per_example_grads(taps: LinearTaps, owners: Sequence[tuple[nn.Linear, str]], output_grads: Sequence[Tensor | None],
                      b: int) -> list[Tensor] | None:  # fmt: skip
    """``(b, *p.shape)`` float32 for each owned tensor p: ``g_j^T x_j`` for a weight, ``sum_t g_jt`` for a bias,
    summed over a module's calls; ``output_grads`` are dL/dy for :meth:`LinearTaps.outputs`, in that order. None when
    a call's leading dimension is not the batch's (a module fed flattened records cannot be split by record).
    (:func:`per_example_matrix`, split back into the tensors' shapes.)"""
    matrix = per_example_matrix(taps, owners, output_grads, b)
    if matrix is None:
        return None
    shapes = [getattr(m, role).shape for m, role in owners]
    return [t.view(b, *s) for t, s in zip(matrix.split([s.numel() for s in shapes], 1), shapes)]


def per_example_matrix(taps: LinearTaps, owners: Sequence[tuple[nn.Linear, str]],
                       output_grads: Sequence[Tensor | None], b: int) -> Tensor | None:  # fmt: skip
    """:func:`per_example_grads` as one ``(b, P)`` float32 matrix: row j is record j's gradient, each owned tensor
    flattened, in ``owners``' order (``P`` the number of their entries); one copy, so that the sum check and the clip
    take a few operations on it instead of a few per tensor."""
    grads_of = _module_grads(taps, owners, output_grads, b)
    if grads_of is None:
        return None
    parts = []
    for m, role in owners:
        t = grads_of.get(m, {}).get(role)
        p = getattr(m, role)
        parts.append(t.flatten(1) if t is not None else torch.zeros(b, p.numel(), device=p.device))
    if not parts:
        return torch.zeros(b, 0)
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0].contiguous()


@functools.lru_cache(maxsize=16)
def _segments(sizes: tuple[int, ...], device: torch.device) -> Tensor:
    """``(sum(sizes),)``: the index i of the tensor each flat entry belongs to."""
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))


def sum_gaps(per_example: Tensor, grads: Sequence[Tensor | None], sizes: Sequence[int]) -> Tensor:
    """``(2, T)`` float64, on the device, no host read: for each of the T tensors (``sizes[i]`` entries, columns of
    ``per_example`` in order), ``|sum_j per_example[j] - grads[i]|`` and ``|grads[i]|`` (a tensor autograd did not
    reach, None, counts as 0)."""
    device = per_example.device
    total = per_example.sum(0).double()
    ref = torch.cat([torch.zeros(n, dtype=torch.float64, device=device) if g is None else g.reshape(-1)
                     for g, n in zip(grads, sizes)]).double()  # fmt: skip
    sq = torch.stack([total - ref, ref]).pow_(2)
    out = torch.zeros(2, len(sizes), dtype=torch.float64, device=device)
    return out.index_add_(1, _segments(tuple(sizes), device), sq).sqrt_()


def sum_mismatch(gaps: Tensor, rtol: float) -> Tensor:
    """0-d bool on the device: some tensor of :func:`sum_gaps` misses its gradient by more than ``rtol`` of its
    norm (what :func:`describe_gaps` reports; NaN counts as a miss)."""
    return (~(gaps[0] <= gaps[1] * rtol + 1e-12)).any()


def describe_gaps(gaps: Tensor, rtol: float) -> str:
    """The empty string when each tensor's gap of :func:`sum_gaps` is within ``rtol`` of its norm; else the first
    that is not (one host read)."""
    for i, (gap, scale) in enumerate(zip(*gaps.tolist())):
        if not gap <= rtol * scale + 1e-12:
            return f"tensor {i}: |sum of per-example gradients - gradient| = {gap:.3g}, |gradient| = {scale:.3g}"
    return ""


def check_sum(per_example: Sequence[Tensor], grads: Sequence[Tensor | None], rtol: float) -> str:
    """The empty string when ``sum_j`` of each per-example gradient equals autograd's gradient of L within ``rtol``
    of its norm (a tensor autograd did not reach counts as 0); else what differs. A tensor used outside its module's
    forward (e.g. read directly to form a merged weight) fails here. One host read for all tensors."""
    if not per_example:
        return ""
    flat = torch.cat([_rows(pe) for pe in per_example], 1)
    return describe_gaps(sum_gaps(flat, grads, [math.prod(pe.shape[1:]) for pe in per_example]), rtol)


def clipped_sum_flat(per_example: Tensor, C: float) -> tuple[Tensor, Tensor]:
    """``(P,)`` float64 ``sum_j c_j g_j`` for the rows g_j of a ``(b, P)`` matrix (:func:`per_example_matrix`), with
    ``c_j = min(1, C / ||g_j||)`` in float64 (:func:`~fs_fedpa.privacy.mechanism.clip_scale`); also the ``(b,)`` c_j.
    On the device, no host read. A record whose norm is not finite contributes exactly zero (c_j = 0, its row zeroed
    first: 0 * inf is NaN)."""
    g = per_example.to(torch.float64, copy=True)  # its own copy: zeroed in place below
    norm = torch.linalg.vector_norm(g, dim=1)  # float64, one pass (no (b, P) squares)
    finite = torch.isfinite(norm)
    # C / ||g_j|| in one rounding (a Python number over a tensor would take the reciprocal first), then min(1, .)
    c = torch.full_like(norm, C).div_(norm).clamp_(max=1.0).masked_fill_(~finite, 0.0)
    g.masked_fill_(~finite[:, None], 0.0)
    return c @ g, c


@functools.lru_cache(maxsize=16)
def column_groups(sizes: tuple[int, ...], groups: tuple[int, ...], device: torch.device) -> Tensor:
    """``(sum(sizes),)``: the clipping group of each flat entry, tensor i's ``sizes[i]`` entries in ``groups[i]``."""
    return torch.tensor(groups, device=device)[_segments(sizes, device)]


def clipped_sum_groups(per_example: Tensor, columns: Tensor, clips: Sequence[float]) -> tuple[Tensor, Tensor]:
    """:func:`clipped_sum_flat` with the columns in clipping groups (``columns``, ``(P,)``: the group of each,
    :func:`column_groups`): ``sum_j c_jg g_jg`` with each record's part in group g clipped on its own norm to
    ``clips[g]``, ``c_jg = min(1, C_g / ||g_jg||)``; also the ``(b, k)`` c_jg. A record with a non-finite norm in any
    group contributes exactly zero (c_j = 0 in every group). On the device, no host read."""
    g = per_example.to(torch.float64, copy=True)
    sq = torch.zeros(g.shape[0], len(clips), dtype=torch.float64, device=g.device)
    sq.index_add_(1, columns, g * g)
    norm = sq.sqrt_()
    finite = torch.isfinite(norm).all(1)
    C = torch.tensor(list(clips), dtype=torch.float64, device=g.device).expand_as(norm)
    c = C.div(norm).clamp_(max=1.0).masked_fill_(~finite[:, None], 0.0)
    g.masked_fill_(~finite[:, None], 0.0)
    return g.mul_(c[:, columns]).sum(0), c


def _rows(pe: Tensor) -> Tensor:
    """``(b, *shape)`` as ``(b, prod(shape))`` (also for b = 0 or a 0-d shape)."""
    return pe.reshape(pe.shape[0], math.prod(pe.shape[1:]))


def clipped_sum(per_example: Sequence[Tensor], C: float) -> tuple[list[Tensor], list[float]]:
    """``sum_j c_j g_j`` in float64 with ``c_j = min(1, C / ||g_j||)``, ``||g_j||`` over all tensors of record j
    jointly (as :func:`fs_fedpa.privacy.mechanism.add_clipped` for one record at a time); also the c_j. A record whose norm is
    not finite (an fp16 overflow, say) contributes exactly zero, c_j = 0 with its tensors zeroed first: 0 * inf
    would make the whole sum NaN, and the step would then depend on that one record. (:func:`clipped_sum_flat` on
    the tensors side by side.)"""
    total, c = clipped_sum_flat(torch.cat([_rows(pe) for pe in per_example], 1), C)
    sizes = [math.prod(pe.shape[1:]) for pe in per_example]
    return [t.view(pe.shape[1:]) for t, pe in zip(total.split(sizes), per_example)], c.tolist()
