"""Reading and writing the LoRA factors of a PEFT model, at any per-module rank. No FederatedScope here.

The one owner of the LoRA factor type (:data:`Factors`) and of the conversions between its spaces.
PEFT applies ``W_0 + s B A`` with ``s = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). Federated
aggregation must average the *updates* ``Delta W_i = s_i B_i A_i``: with heterogeneous ranks the raw
factors of different clients are on different scales. :class:`Scaling` gives ``s(r)`` per module and
folds it into B (the *applied* space of the server, the aggregation and the downlink);
:class:`ClientSpace` converts a client's factors, kept in that space too, into and out of its model.

A client of rank r_i trains rank-r_i LoRA even when FS shares one model object between all
clients: :func:`set_factors` swaps the ``lora_A``/``lora_B`` weights of every module for
tensors of the client's rank and updates PEFT's ``r`` and ``scaling`` to match. FS builds a new
optimizer at every training routine, so it picks up the swapped parameters.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

Factors = dict[str, tuple[Tensor, Tensor]]  # module name -> (B: (d, r), A: (r, k))


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``name -> PEFT LoraLayer`` for every LoRA-adapted module (active adapter), in model order."""
    from peft.tuners.lora import LoraLayer

    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and _adapter(module) in module.lora_A:
            layers[name] = module
    return layers


def get_factors(model: nn.Module) -> Factors:
    """The live ``(lora_B.weight, lora_A.weight)`` parameters of every LoRA module (not copies)."""
    out = {}
    for name, layer in lora_layers(model).items():
        adapter = _adapter(layer)
        out[name] = (layer.lora_B[adapter].weight, layer.lora_A[adapter].weight)
    return out


def built_rank(layer: nn.Module) -> int:
    """The rank PEFT built ``layer`` with, kept on the layer before :func:`set_factors` first changes it: a model
    whose factors were since replaced at another rank still gives it (one model shared by the clients, into which
    a resumed run's server loaded its global at rank R_g, or Ravan's H r_h, before the clients read their plan)."""
    if getattr(layer, "_fedpa_r0", None) is None:
        layer._fedpa_r0 = int(layer.r[_adapter(layer)])
    return layer._fedpa_r0


def scaling_for_rank(layer: nn.Module, r: int) -> float:
    """``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA): what PEFT would use for rank r on this module."""
    adapter = _adapter(layer)
    return _peft_scaling(layer.lora_alpha[adapter], layer.use_rslora.get(adapter, False), r)


def _peft_scaling(alpha: float, rslora: bool, r: int) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


def set_factors(
    model: nn.Module, factors: Mapping[str, tuple[Tensor, Tensor]], *, trainable: bool | tuple[bool, bool] = True
) -> None:
    """Replace the LoRA weights of the named modules by copies of ``(B, A)``, whatever their rank.

    The copies take the device and dtype of the weights they replace; PEFT's ``r`` and
    ``scaling`` follow the new rank, so ``W_0 + (alpha/r) B A`` is what the model computes.
    ``trainable`` sets ``requires_grad`` of both factors, or of (B, A) separately.
    """
    train_B, train_A = (trainable, trainable) if isinstance(trainable, bool) else trainable
    layers = lora_layers(model)
    unknown = sorted(set(factors) - set(layers))
    if unknown:
        raise KeyError(f"no LoRA module named {unknown[:3]}{'...' if len(unknown) > 3 else ''} in the model")
    with torch.no_grad():
        for name, (B, A) in factors.items():
            layer = layers[name]
            adapter = _adapter(layer)
            lin_A, lin_B = layer.lora_A[adapter], layer.lora_B[adapter]
            r = B.shape[1]
            if A.shape[0] != r or B.shape[0] != lin_B.weight.shape[0] or A.shape[1] != lin_A.weight.shape[1]:
                raise ValueError(
                    f"{name}: factors B {tuple(B.shape)}, A {tuple(A.shape)} do not fit the layer "
                    f"({lin_B.weight.shape[0]} x {lin_A.weight.shape[1]})"
                )
            built_rank(layer)  # kept before the first change
            old = lin_A.weight
            lin_A.weight = nn.Parameter(A.detach().to(old.device, old.dtype, copy=True), requires_grad=train_A)
            lin_B.weight = nn.Parameter(
                B.detach().to(lin_B.weight.device, lin_B.weight.dtype, copy=True), requires_grad=train_B
            )
            lin_A.out_features = lin_B.in_features = r
            layer.r[adapter] = r
            layer.scaling[adapter] = scaling_for_rank(layer, r)


def scale_adapters(model: nn.Module, factor: float) -> None:
    """Multiply PEFT's ``scaling`` of every LoRA module by ``factor`` (until the next :func:`set_factors`, which
    sets it from the rank again): the model then applies ``factor * s(r) B A``, and its gradients scale alike."""
    for layer in lora_layers(model).values():
        layer.scaling[_adapter(layer)] *= factor


def keep_base(model: nn.Module) -> None:
    """Keep a copy ``W_0`` of every LoRA module's frozen base weight on the layer, unless one is kept already: one
    copy per model object, so workers sharing a model share it. Call before any offset is set or any checkpoint is
    loaded: :func:`set_base_offsets` computes from it."""
    for layer in lora_layers(model).values():
        _kept_base(layer)


def _kept_base(layer: nn.Module) -> Tensor:
    if getattr(layer, "_fedpa_w0", None) is None:
        layer._fedpa_w0 = layer.get_base_layer().weight.detach().clone()
    return layer._fedpa_w0


def set_base_offsets(model: nn.Module, offsets: Mapping[str, Tensor]) -> None:
    """Set the frozen base weight of every LoRA module to ``W_0 + offsets[name]`` (``(d, k)``, the update's
    orientation), computed in at least float32 and stored in the weight's dtype, and of every module ``offsets``
    does not name back to ``W_0`` (as :func:`keep_base` kept it)."""
    layers = lora_layers(model)
    if unknown := sorted(set(offsets) - set(layers)):
        raise KeyError(f"no LoRA module named {unknown[:3]}{'...' if len(unknown) > 3 else ''} in the model")
    with torch.no_grad():
        for name, layer in layers.items():
            weight, w0 = layer.get_base_layer().weight, _kept_base(layer)
            offset = offsets.get(name)
            if offset is None:
                weight.copy_(w0)
                continue
            weight.copy_(offset_base(layer, offset, name))


def offset_base(layer: nn.Module, offset: Tensor, name: str = "") -> Tensor:
    """``W_0 + offset`` of a LoRA module (``offset`` (d, k), the update's orientation), computed in at least float32
    and returned in the weight's dtype and orientation, beside the layer's live weight."""
    weight, w0 = layer.get_base_layer().weight, _kept_base(layer)
    if getattr(layer, "fan_in_fan_out", False):  # e.g. GPT-2's Conv1D stores W^T
        offset = offset.T
    if offset.shape != w0.shape:
        raise ValueError(f"{name}: base offset {tuple(offset.shape)} does not fit the weight {tuple(w0.shape)}")
    dtype = torch.promote_types(w0.dtype, torch.float32)
    return (w0.to(dtype) + offset.to(w0.device, dtype)).to(weight.dtype)


def adapter_weights(layer: nn.Module) -> tuple[nn.Parameter, nn.Parameter]:
    """The ``(B, A)`` weights of a LoRA module's one active adapter."""
    adapter = _adapter(layer)
    return layer.lora_B[adapter].weight, layer.lora_A[adapter].weight


class RowGate:
    """Per-input mix of two adapters loaded as one: with factors ``([B_1, B_2], [A_1; A_2])`` (``A_1`` of rank
    ``split``) in every LoRA module, input row b applies ``g_b s B_1 A_1 + (1 - g_b) s B_2 A_2`` (FedDPA's
    instance-wise weighting). ``g`` is a ``(batch,)`` tensor set before each forward; None applies both fully.
    Forward hooks on every ``lora_A`` scale its output channels; :meth:`remove` takes them off."""

    def __init__(self, model: nn.Module, split: int):
        self.split, self.g = split, None
        self._handles = [layer.lora_A[_adapter(layer)].register_forward_hook(self._mix) for layer in
                         lora_layers(model).values()]  # fmt: skip

    def _mix(self, module: nn.Module, inputs, output: Tensor) -> Tensor | None:
        if self.g is None:
            return None
        if self.g.shape != output.shape[:1]:
            raise ValueError(f"RowGate: {self.g.shape[0]} weights for a batch of {output.shape[0]} rows")
        g = self.g.to(output).view(-1, *[1] * (output.ndim - 1))
        return torch.cat([output[..., : self.split] * g, output[..., self.split :] * (1 - g)], dim=-1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class Heads(nn.Module):
    """Ravan's trainable part of one LoRA layer: cores ``H_h`` (r_h x r_h) and scales ``s_h``, h = 1..H; only the
    heads in ``trainable`` have trainable parameters. On ``lora_A``'s output ``z = [z_1, ..., z_H]`` (..., H r_h) it
    returns ``[s_1 H_1 z_1, ..., s_H H_H z_H]``: with the frozen bases ``[B_1 .. B_H]`` in ``lora_B``,
    ``[A_1; ..; A_H]`` in ``lora_A`` and PEFT's scaling 1, the layer applies ``W_0 + sum_h s_h B_h H_h A_h``."""

    def __init__(self, cores: Tensor, scales: Tensor, trainable: Collection[int] = ()):
        super().__init__()
        self.cores = nn.ParameterList(
            nn.Parameter(c.detach().clone(), requires_grad=h in trainable) for h, c in enumerate(cores)
        )
        self.scales = nn.ParameterList(
            nn.Parameter(s.detach().clone(), requires_grad=h in trainable) for h, s in enumerate(scales)
        )

    def forward(self, z: Tensor) -> Tensor:
        H = torch.stack(list(self.cores)) * torch.stack(list(self.scales))[:, None, None]  # (H, r_h, r_h)
        return torch.einsum("...hr,hqr->...hq", z.unflatten(-1, H.shape[:2]), H).flatten(-2)


def set_heads(
    model: nn.Module, bases: Mapping[str, tuple[Tensor, Tensor]], heads: Mapping[str, tuple[Tensor, Tensor]],
    trainable: Collection[int] = (),
) -> None:  # fmt: skip
    """Load Ravan's adapter: the frozen ``bases[name] = (B: (d, H r_h), A: (H r_h, k))`` as ``lora_B``/``lora_A``
    with scaling 1, and copies of ``heads[name] = (cores: (H, r_h, r_h), scales: (H,))`` as the layer's
    :class:`Heads`, the heads in ``trainable`` trainable. A forward hook on ``lora_A`` applies them."""
    set_factors(model, bases, trainable=False)
    layers = lora_layers(model)
    for name, (cores, scales) in heads.items():
        layer, (B, _) = layers[name], bases[name]
        if cores.ndim != 3 or cores.shape[1] != cores.shape[2] or cores.shape[0] * cores.shape[1] != B.shape[1]:
            raise ValueError(f"{name}: cores {tuple(cores.shape)} do not fit bases of rank {B.shape[1]}")
        if scales.shape != cores.shape[:1]:
            raise ValueError(f"{name}: scales {tuple(scales.shape)} for {cores.shape[0]} heads")
        adapter = _adapter(layer)
        weight = layer.lora_B[adapter].weight
        layer.scaling[adapter] = 1.0  # Ravan has no alpha / r: its scales are the s_h
        layer.fedpa_heads = Heads(cores.to(weight.device, weight.dtype), scales.to(weight.device, weight.dtype),
                                  trainable)  # fmt: skip
        if not getattr(layer, "_fedpa_heads_hook", None):
            layer._fedpa_heads_hook = layer.lora_A[adapter].register_forward_hook(
                lambda module, inputs, output, layer=layer: layer.fedpa_heads(output)
            )


def get_heads(model: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
    """``name -> (cores: (H, r_h, r_h), scales: (H,))``: detached copies of every layer's :class:`Heads`."""
    out = {}
    for name, layer in lora_layers(model).items():
        if (heads := getattr(layer, "fedpa_heads", None)) is not None:
            out[name] = (
                torch.stack([c.detach() for c in heads.cores]),
                torch.stack([s.detach() for s in heads.scales]),
            )
    return out


@dataclass(frozen=True)
class Scaling:
    """PEFT's scaling ``s(r)`` of every LoRA module as a function of the rank: ``alpha / r``, or ``alpha / sqrt(r)``
    with rsLoRA. Read once from the model's config (``lora_alpha``, ``use_rslora``), never from its live state, so a
    conversion depends only on the factors' rank.

    *Applied* factors ``(s(r) B, A)`` have the update ``Delta W = s(r) B A`` the model applies as their product: the
    server, the aggregation and the downlink live in that space.
    """

    alpha: Mapping[str, float]
    rslora: Mapping[str, bool]

    @classmethod
    def of(cls, model: nn.Module) -> Scaling:
        layers = lora_layers(model)
        return cls(
            {n: float(layer.lora_alpha[_adapter(layer)]) for n, layer in layers.items()},
            {n: bool(layer.use_rslora.get(_adapter(layer), False)) for n, layer in layers.items()},
        )

    def record(self) -> dict[str, dict]:
        """``{"alpha": {module: lora_alpha}, "rslora": {module: use_rslora}}``: what a checkpoint keeps of it."""
        return {"alpha": dict(self.alpha), "rslora": dict(self.rslora)}

    def s(self, name: str, r: int) -> float:
        """``s(r)`` of module ``name``."""
        return _peft_scaling(self.alpha[name], self.rslora[name], r)

    def applied(self, factors: Mapping[str, tuple[Tensor, Tensor]]) -> Factors:
        """``(s(r) B, A)`` with r the rank of each pair: raw PEFT factors to the update they apply."""
        return {n: (B * self.s(n, B.shape[-1]), A) for n, (B, A) in factors.items()}

    def raw(self, factors: Mapping[str, tuple[Tensor, Tensor]]) -> Factors:
        """``(B / s(r), A)``: the raw PEFT factors that apply ``B A`` at rank r (inverse of :meth:`applied`)."""
        return {n: (B / self.s(n, B.shape[-1]), A) for n, (B, A) in factors.items()}


@dataclass(frozen=True)
class ClientSpace:
    """Client i's factor space, of computation rank r_i: the applied factors ``(s(r) B, A)`` of the server, the
    aggregation and the uploads. The client receives, keeps, starts from, measures and uploads its factors in it;
    they are converted only into the model (:meth:`into_model`, the round's start and its alignment reference) and
    out of it (:meth:`from_model`, what it trained). Every method hook on the client works in this space; those that
    compare or rescale factors are scale-equivariant.

    Bit for bit: a pair of rank r_i that goes into the model and out again is ``(B / s_i) s_i``, which is ``B``
    wherever ``s_i`` is a power of two (``lora_alpha / r``: 8 / 4 in the protocol); another ``s_i`` costs one
    rounding a round.
    """

    scaling: Scaling
    rank: int

    def s_i(self, name: str) -> float:
        return self.scaling.s(name, self.rank)

    def into_model(self, factors: Mapping[str, tuple[Tensor, Tensor]],
                   reference: Mapping[str, tuple[Tensor, Tensor]] | None = None) -> tuple[Factors, Factors]:
        """What goes into the model: the raw PEFT factors applying ``factors`` (``B / s(r)`` for a pair of rank r),
        and ``reference`` (any rank) in the frame of the model's rank-r_i factors, ``B / s_i``: the alignment term is
        ``||B_i A_i - X / s_i||^2`` (weighted by :meth:`penalty_weight`)."""
        return self.scaling.raw(factors), {n: (B / self.s_i(n), A) for n, (B, A) in (reference or {}).items()}

    def from_model(self, raw: Mapping[str, tuple[Tensor, Tensor]]) -> Factors:
        """``(s(r) B, A)``: the applied factors of the model's raw ones (inverse of :meth:`into_model`)."""
        return self.scaling.applied(raw)

    def penalty_weight(self, reference_rank: int) -> float:
        """``(s_i / s(r))^2`` for the configured adapter rank r: the factor that turns the common lambda, quoted in
        the raw-factor scale of rank r (``lam/2 ||Delta W_i - X||^2 / s(r)^2``), into this client's weight on
        ``||B_i A_i - X / s_i||^2``. The ratio does not depend on alpha; it is 1 when r_i == r."""
        ratios = {(self.s_i(n) / self.scaling.s(n, reference_rank)) ** 2 for n in self.scaling.alpha}
        if len(ratios) > 1:
            raise ValueError(f"LoRA modules mix rsLoRA and plain scaling: {sorted(ratios)}; one lambda needs one rule")
        return ratios.pop() if ratios else 1.0


@dataclass(frozen=True)
class UnitSpace(ClientSpace):
    """The client space of a method whose state is applied without PEFT's scaling (Ravan's heads): every
    conversion is the identity."""

    scaling: Scaling = Scaling({}, {})
    rank: int = 0

    def s_i(self, name: str) -> float:
        return 1.0

    def into_model(self, factors, reference=None) -> tuple[Factors, Factors]:
        return dict(factors), dict(reference or {})

    def from_model(self, raw) -> Factors:
        return dict(raw)

    def penalty_weight(self, reference_rank: int) -> float:
        return 1.0


def copy_factors(factors: Mapping[str, tuple[Tensor, Tensor]], device: torch.device | str | None = None) -> Factors:
    """Detached clones (optionally moved): what a client stashes and what goes on the wire."""
    return {n: (B.detach().to(device, copy=True), A.detach().to(device, copy=True)) for n, (B, A) in factors.items()}


def _adapter(layer: nn.Module) -> str:
    active = layer.active_adapters
    if len(active) != 1:
        raise ValueError(f"fs_fedpa supports exactly one active LoRA adapter per module, found {active}")
    return active[0]
