"""A classifier head refitted on a client's training data with the rest of the model held: the diagnostic that
separates what an adapter's features can do from what the head it was trained with makes of them (issue 71, item 4:
a head trained with a client's own factors reads the global adapter's features wrongly). No FS import.

The refit is multinomial logistic regression on the head's inputs X (n, h) with labels y (n,) in [0, K):

    W, b = argmin  (1/n) Σ_j CE(W x_j + b, y_j) + (1 / (2 C n)) ‖W‖²_F      (b unpenalised),

scikit-learn's ``LogisticRegression(C=C)`` objective divided by C n, solved by L-BFGS. A diagnostic only: the head
sees the training records exactly, so nothing it scores is covered by a DP guarantee.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

C_DEFAULT = 1.0  # scikit-learn's default inverse regularisation


def head_of(model: nn.Module, names: Iterable[str]) -> nn.Linear:
    """The last ``nn.Linear`` inside a module whose qualified name contains one of ``names`` (the client's local
    tensors, e.g. ``personalization.local_param ['classifier']``), skipping PEFT's inactive ``original_module``
    copy: the layer that maps the head's input to the logits."""
    names = [n for n in names if n]
    found = [
        module
        for qualified, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and any(n in qualified for n in names)
        and "original_module" not in qualified.split(".")
        and "lora_" not in qualified
    ]
    if not found:
        raise ValueError(f"no linear classifier head among the modules named by {names}")
    return found[-1]


def head_inputs(head: nn.Linear, batches: Iterable[tuple[object, Tensor]], forward: Callable[[object, Tensor], None]):
    """``(X (n, h) float32 on the host, y (n,) long)``: the inputs of ``head`` on every record of ``batches``
    (``(features, labels)`` pairs), each run through ``forward(features, labels)`` with gradients off."""
    seen: list[Tensor] = []

    def keep(module, args):
        seen.append(args[0].detach().float().cpu())

    handle = head.register_forward_pre_hook(keep)
    labels = []
    try:
        with torch.no_grad():
            for features, y in batches:
                forward(features, y)
                labels.append(torch.as_tensor(y).reshape(-1).cpu())
    finally:
        handle.remove()
    if not seen:
        return torch.zeros(0, head.in_features), torch.zeros(0, dtype=torch.long)
    X = torch.cat(seen)
    if X.ndim != 2:
        raise ValueError(f"the head's inputs have shape {tuple(X.shape)}; a refit needs one vector a record")
    return X, torch.cat(labels).long()


def fit_softmax_head(X: Tensor, y: Tensor, classes: int, c: float = C_DEFAULT, steps: int = 500):
    """``(W (K, h), b (K,))``, float64, minimising the module docstring's objective (L-BFGS from zero). A shard of
    one label gets W = 0 and b putting that label first (the objective has no finite minimiser there)."""
    n, h = X.shape
    if n == 0:
        raise ValueError("a head refit needs at least one training record")
    present = torch.unique(y)
    if len(present) == 1:
        b = torch.full((classes,), -1.0, dtype=torch.float64)
        b[int(present)] = 1.0
        return torch.zeros(classes, h, dtype=torch.float64), b
    X64, mu = X.double(), 1.0 / (c * n)
    W = torch.zeros(classes, h, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
    solver = torch.optim.LBFGS([W, b], lr=1.0, max_iter=steps, tolerance_grad=1e-10, tolerance_change=1e-14,
                               history_size=20, line_search_fn="strong_wolfe")  # fmt: skip

    def objective():
        solver.zero_grad()
        loss = nn.functional.cross_entropy(X64 @ W.T + b, y) + 0.5 * mu * (W * W).sum()
        loss.backward()
        return loss

    solver.step(objective)
    return W.detach(), b.detach()


@contextmanager
def swapped(head: nn.Linear, W: Tensor, b: Tensor) -> Iterator[None]:
    """``head`` computes ``W x + b`` inside the block; its own weight and bias (values, dtype, device) after."""
    if head.bias is None:
        raise ValueError("a head refit needs a classifier head with a bias")
    kept = head.weight.detach().clone(), head.bias.detach().clone()
    with torch.no_grad():
        head.weight.copy_(W.to(head.weight))
        head.bias.copy_(b.to(head.bias))
    try:
        yield
    finally:
        with torch.no_grad():
            head.weight.copy_(kept[0])
            head.bias.copy_(kept[1])
