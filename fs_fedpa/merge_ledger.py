"""The merges exact-aggregation methods add to the base weights (FLoRA, FedEx-LoRA, ...), as the server keeps
them: their running sum, the newest as it travels, and how many of them each client's base offset holds. Plain
torch; the server (:class:`~fs_fedpa.plugin.server.FedPAServer`) owns one and its resume points carry it."""

from __future__ import annotations

import torch
from torch import Tensor

from fs_fedpa.state_checks import check_fields, check_finite, check_int, check_tensor, check_tensors, is_int


class MergeLedger:
    """``merged``: per module the (d, k) sum of every merge so far; ``last``: the newest merge as it travels (per
    module its dense increment, or a copy of its factors); ``count``: merges so far; ``upto[c]``: how many merges
    client c's base offset holds; ``kept[c]``: the same at its last training message, which is what its resume file
    holds (evaluation messages may send merges after it)."""

    def __init__(self):
        self.merged: dict[str, Tensor] = {}
        self.last: dict | None = None
        self.count = 0
        self.upto: dict[int, int] = {}
        self.kept: dict[int, int] = {}

    def add(self, merge: dict[str, tuple[Tensor, Tensor]], dense: bool) -> None:
        """One round's merge (factors per module): ``merged += B A`` in at least float32, and how it travels:
        ``dense``, its increment formed here once (not once per receiver), else a copy of its factors."""
        travels = {}
        for name, (B, A) in merge.items():
            dtype = torch.promote_types(B.dtype, torch.float32)
            increment = B.to(dtype) @ A.to(dtype)
            self.merged[name] = self.merged[name] + increment if name in self.merged else increment
            travels[name] = increment.to(B.dtype) if dense else (B.detach().clone(), A.detach().clone())
        self.last, self.count = travels, self.count + 1

    def pending(self, client: int) -> tuple[str, object] | None:
        """What ``client`` lacks of the merges, now counted as received: ``("base", [newest merge])`` when it lacks
        only the newest (every client, every round, with full participation), ``("base_total", merged)``, the sum of
        every merge (d, k), which replaces its base offset, when it lacks more; None when it lacks none. Whatever the
        number of clients and however long one sits out, the ledger keeps the newest merge and the sum only: the sum
        is what the client would have added up, in the same order, so its base offset is the same."""
        upto = self.upto.get(client, 0)
        if upto >= self.count:
            return None
        self.upto[client] = self.count
        if upto == self.count - 1 and self.last is not None:
            return "base", [self.last]
        return "base_total", self.merged

    def trained(self, client: int) -> None:
        """``client`` is sent a training message: its resume file will hold what its base offset holds now."""
        self.kept[client] = self.upto.get(client, 0)

    def forget(self, client: int) -> None:
        """``client`` lost its stored state, merges included: its next message carries them all."""
        self.upto[client] = 0

    def state_dict(self) -> dict:
        """For a resume point, on the CPU. ``kept`` stands for ``upto``: evaluation messages are sent again after a
        resume."""
        return {
            "merged": {n: t.cpu() for n, t in self.merged.items()},
            "last": _moved(self.last, "cpu") if self.last is not None else {},
            "count": self.count,
            "kept": dict(self.kept),
        }

    def check_state(self, saved, at: str, field: str, shapes: dict[str, tuple[int, int]]) -> None:
        """ValueError naming ``at`` and ``field.<key>`` unless ``saved`` is :meth:`state_dict`'s dict for modules of
        ``shapes`` (d, k): dense finite sums and increments (or factor pairs) of known modules, ``count`` an int >= 0
        and ``kept`` at most ``count`` merges per client id."""
        check_fields(saved, at, field, ("merged", "last", "count", "kept"))
        check_tensors(saved["merged"], at, f"{field}.merged", shapes, exact=False)
        check_int(saved, at, "count", 0, field=f"{field}.count")
        last = saved["last"]
        if not isinstance(last, dict) or not set(last) <= set(shapes):
            raise ValueError(f"{at}: field '{field}.last' is not a merge of this run's modules")
        for name, value in last.items():
            for t in value if isinstance(value, (tuple, list)) else (value,):
                check_tensor(t, f"{at}: field '{field}.last[{name!r}]'")
                check_finite(t, f"{at}: field '{field}.last[{name!r}]'")
        kept = saved["kept"]
        if not isinstance(kept, dict) or not all(is_int(c) and is_int(n) and 0 <= n <= saved["count"]
                                                 for c, n in kept.items()):  # fmt: skip
            raise ValueError(f"{at}: field '{field}.kept' is {kept!r:.100}, not merges held per client id")

    def load_state_dict(self, saved: dict, device) -> None:
        """:meth:`state_dict`'s dict onto ``device``."""
        self.merged = {n: t.to(device) for n, t in saved["merged"].items()}
        self.count = saved["count"]
        self.last = _moved(saved["last"], device) if saved["last"] else None
        self.upto, self.kept = dict(saved["kept"]), dict(saved["kept"])


def _moved(merge: dict, device) -> dict:
    """A logged merge (per module its dense increment or its factors) on ``device``."""
    return {n: v.to(device) if isinstance(v, Tensor) else (v[0].to(device), v[1].to(device)) for n, v in merge.items()}
