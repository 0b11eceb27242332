"""Reading and writing the LoRA factors of a PEFT model, at any per-module rank. No FederatedScope here.

PEFT applies ``W_0 + s B A`` with ``s = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). Federated
aggregation must average the *updates* ``s_i B_i A_i``: with heterogeneous ranks the raw factors
of different clients are on different scales. :func:`effective` folds ``s`` into B; the
server and the references live in that effective space.

A client of rank r_i trains rank-r_i LoRA even when FS shares one model object between all
clients: :func:`set_factors` swaps the ``lora_A``/``lora_B`` weights of every module for
tensors of the client's rank and updates PEFT's ``r`` and ``scaling`` to match. FS builds a new
optimizer at every training routine, so it picks up the swapped parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

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


def scaling(model: nn.Module) -> dict[str, float]:
    """PEFT's current ``scaling`` s of every LoRA module."""
    return {name: float(layer.scaling[_adapter(layer)]) for name, layer in lora_layers(model).items()}


def scaling_for_rank(layer: nn.Module, r: int) -> float:
    """``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA): what PEFT would use for rank r on this module."""
    adapter = _adapter(layer)
    alpha = layer.lora_alpha[adapter]
    return alpha / math.sqrt(r) if layer.use_rslora.get(adapter, False) else alpha / r


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
            old = lin_A.weight
            lin_A.weight = nn.Parameter(A.detach().to(old.device, old.dtype, copy=True), requires_grad=train_A)
            lin_B.weight = nn.Parameter(
                B.detach().to(lin_B.weight.device, lin_B.weight.dtype, copy=True), requires_grad=train_B
            )
            lin_A.out_features = lin_B.in_features = r
            layer.r[adapter] = r
            layer.scaling[adapter] = scaling_for_rank(layer, r)


def effective(factors: Mapping[str, tuple[Tensor, Tensor]], scales: Mapping[str, float]) -> Factors:
    """``(s B, A)`` per module: factors whose product is the update ``s B A`` the model applies."""
    return {name: (B * scales[name], A) for name, (B, A) in factors.items()}


def from_effective(layers: Mapping[str, nn.Module], factors: Mapping[str, tuple[Tensor, Tensor]]) -> Factors:
    """Inverse of :func:`effective` at each factor's own rank: ``(B / s(r), A)`` for PEFT's ``s(r)`` of that module."""
    return {name: (B / scaling_for_rank(layers[name], B.shape[1]), A) for name, (B, A) in factors.items()}


def copy_factors(factors: Mapping[str, tuple[Tensor, Tensor]], device: torch.device | str | None = None) -> Factors:
    """Detached clones (optionally moved): what a client stashes and what goes on the wire."""
    return {n: (B.detach().to(device, copy=True), A.detach().to(device, copy=True)) for n, (B, A) in factors.items()}


def _adapter(layer: nn.Module) -> str:
    active = layer.active_adapters
    if len(active) != 1:
        raise ValueError(f"fs_fedpa supports exactly one active LoRA adapter per module, found {active}")
    return active[0]
