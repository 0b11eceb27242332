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

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fs_fedpa.privacy.mechanism import clip_scale

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


def per_example_grads(taps: LinearTaps, owners: Sequence[tuple[nn.Linear, str]], output_grads: Sequence[Tensor | None],
                      b: int) -> list[Tensor] | None:  # fmt: skip
    """``(b, *p.shape)`` float32 for each owned tensor p: ``g_j^T x_j`` for a weight, ``sum_t g_jt`` for a bias,
    summed over a module's calls; ``output_grads`` are dL/dy for :meth:`LinearTaps.outputs`, in that order. None when
    a call's leading dimension is not the batch's (a module fed flattened records cannot be split by record)."""
    grads_of: dict[nn.Module, dict[str, Tensor]] = {}
    k = 0
    for m in taps.modules:
        acc: dict[str, Tensor] = {}
        for x, _ in taps.calls[m]:
            g = output_grads[k]
            k += 1
            if g is None:
                continue
            if x.shape[0] != b or g.shape[0] != b:
                return None
            x3 = x.reshape(b, -1, x.shape[-1]).float()
            g3 = g.reshape(b, -1, g.shape[-1]).float()
            parts = {"weight": torch.bmm(g3.transpose(1, 2), x3), "bias": g3.sum(1)}
            for role, t in parts.items():
                acc[role] = t if role not in acc else acc[role] + t
        grads_of[m] = acc
    out = []
    for m, role in owners:
        t = grads_of.get(m, {}).get(role)
        out.append(t if t is not None else torch.zeros(b, *getattr(m, role).shape, device=getattr(m, role).device))
    return out


def check_sum(per_example: Sequence[Tensor], grads: Sequence[Tensor | None], rtol: float) -> str:
    """The empty string when ``sum_j`` of each per-example gradient equals autograd's gradient of L within ``rtol``
    of its norm (a tensor autograd did not reach counts as 0); else what differs. A tensor used outside its module's
    forward (e.g. read directly to form a merged weight) fails here."""
    for i, (pe, g) in enumerate(zip(per_example, grads)):
        total = pe.sum(0).double()
        ref = torch.zeros_like(total) if g is None else g.double()
        gap, scale = float((total - ref).norm()), float(ref.norm())
        if not gap <= rtol * scale + 1e-12:
            return f"tensor {i}: |sum of per-example gradients - gradient| = {gap:.3g}, |gradient| = {scale:.3g}"
    return ""


def clipped_sum(per_example: Sequence[Tensor], C: float) -> tuple[list[Tensor], list[float]]:
    """``sum_j c_j g_j`` in float64 with ``c_j = min(1, C / ||g_j||)``, ``||g_j||`` over all tensors of record j
    jointly (as :func:`fs_fedpa.privacy.mechanism.add_clipped` for one record at a time); also the c_j. A record whose norm is
    not finite (an fp16 overflow, say) contributes exactly zero, c_j = 0 with its tensors zeroed first: 0 * inf
    would make the whole sum NaN, and the step would then depend on that one record."""
    sq = sum(pe.double().flatten(1).pow(2).sum(1) for pe in per_example)
    scales = [clip_scale(float(s), C) for s in sq.cpu()]
    c = torch.tensor(scales, dtype=torch.float64, device=per_example[0].device)
    finite = torch.isfinite(sq)
    total = []
    for pe in per_example:
        keep = finite.view(-1, *([1] * (pe.ndim - 1)))
        total.append(torch.einsum("b,b...->...", c, torch.where(keep, pe.double(), 0.0)))
    return total, scales
