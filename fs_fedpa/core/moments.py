"""``fedpa.keep_moments``: an optimizer's per-parameter state (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``) carried
from one training routine to the next, keyed by parameter name (``"<name>:<key>"``), never by position.

A routine builds a fresh optimizer; :meth:`KeptMoments.restore` puts the kept state into it before its first step,
:meth:`KeptMoments.save` takes the state back after its last. Under DP-SGD the state is post-processing: the
optimizer sees only the gradients it is given (the noised clipped sum plus data-free terms)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

SEP = ":"


class KeptMoments:
    """``tensors``: ``{"<parameter name>:<state key>": tensor}`` on the CPU (an empty dict: nothing kept yet)."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}

    def save(self, optimizer: torch.optim.Optimizer, named: Mapping[str, Tensor]) -> None:
        """The state of every parameter of ``optimizer`` that ``named`` (``name -> parameter``) names; a parameter
        the routine did not step keeps what it had."""
        names = {id(p): n for n, p in named.items()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names or not optimizer.state.get(p):
                    continue
                for key, value in optimizer.state[p].items():
                    if value is None:
                        continue
                    t = value if isinstance(value, Tensor) else torch.tensor(float(value))
                    self.tensors[f"{names[id(p)]}{SEP}{key}"] = t.detach().cpu().clone()

    def restore(self, optimizer: torch.optim.Optimizer, named: Mapping[str, Tensor]) -> int:
        """Put the kept state of each parameter of ``optimizer`` (by its name in ``named``) into ``optimizer.state``;
        0-d tensors (AdamW's ``step``) stay on the CPU as torch keeps them, the others go to the parameter's device.
        Returns how many parameters got a state."""
        by_name: dict[str, dict[str, Tensor]] = {}
        for label, t in self.tensors.items():
            name, _, key = label.rpartition(SEP)
            by_name.setdefault(name, {})[key] = t
        names = {id(p): n for n, p in named.items()}
        restored = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = by_name.get(names.get(id(p), ""))
                if state:
                    optimizer.state[p] = {k: t.clone() if t.dim() == 0 else t.to(p.device, copy=True)
                                          for k, t in state.items()}  # fmt: skip
                    restored += 1
        return restored

    def clear(self) -> None:
        self.tensors = {}

    def state_dict(self) -> dict[str, Tensor]:
        return {k: t.detach().cpu().clone() for k, t in self.tensors.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        self.tensors = {k: t.detach().cpu().clone() for k, t in state.items()}
