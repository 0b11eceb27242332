"""A client's state between messages: parked in the run's :class:`~fs_fedpa.state_store.StateStore` (host
memory, or disk beyond ``fedpa.state_budget_mb``) after each message and brought back before the next.
:class:`ClientState` is a mixin of :class:`~fs_fedpa.plugin.client.FedPAClient`."""

from __future__ import annotations

import logging
import os

from fs_fedpa import lora
from fs_fedpa.state_store import SpillError, StateStore, flatten, unflatten

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only
_STORES: dict[str, StateStore] = {}  # one per run folder: the clients of a standalone run share its budget


class ClientState:
    """Parking, restoring and releasing what the client keeps across rounds."""

    def _park(self) -> None:
        """After each message: what this client keeps goes to the state store (host memory, or disk beyond
        ``fedpa.state_budget_mb``), and nothing of it, nor of the round's reference, stays on the model's device."""
        parts = {"factors": self.factors, "local": self.local_tensors, "base_offset": self.base_offset,
                 "personal": self.personal, "fold": self._fold}  # fmt: skip
        if self.method.cfg.export_dir:
            parts["received"] = self._last_received
        self.store.put(self.ID, flatten(parts))
        self._parked = True
        self._release_state()

    def _release_state(self) -> None:
        """Drop this client's references to its state and to the round's reference (parked, or the run is over)."""
        self.factors = self.personal = self._fold = self._last_received = None
        self.local_tensors, self.base_offset = {}, {}
        self._received = {}
        self.alignment.clear()

    def _unpark(self) -> None:
        """Before each message: this client's state from the store onto the model's device. A stored state that
        cannot be read back is this client's loss alone: it is logged, and the client restarts from the reference
        it receives, with the initial local tensors (docs/errors.md)."""
        if not self._parked:
            return
        self._parked = False
        try:
            flat = self.store.get(self.ID) or {}
        except SpillError as exc:
            logger.warning(f"[fedpa] {exc}; client #{self.ID} restarts from the global reference it receives and "
                           "its initial local tensors")  # fmt: skip
            flat, self._state_lost = flatten({"local": self.store.initial_local}), True
        parts = unflatten(flat)
        device = self._device

        def pairs(part):
            return {n: (B.to(device), A.to(device)) for n, (B, A) in parts[part].items()} if part in parts else None

        self.factors, self.personal, self._fold, self._last_received = (
            pairs(p) for p in ("factors", "personal", "fold", "received")
        )
        self.local_tensors = {n: t.to(device) for n, t in parts.get("local", {}).items()}
        self.base_offset = {n: t.to(device) for n, t in parts.get("base_offset", {}).items()}

    def local_state(self) -> dict:
        """Everything this client keeps across rounds (raw factors, local tensors), on the CPU."""
        return {
            "round": self.state,
            "client": self.ID,
            "rank": self.method.plan.client_ranks[self.index],
            "factors": lora.copy_factors(self.factors, "cpu"),
            "local": {n: t.detach().cpu().clone() for n, t in self.local_tensors.items()},
            "base_offset": {n: t.cpu() for n, t in self.base_offset.items()},
            "personal": lora.copy_factors(self.personal, "cpu") if self.personal is not None else {},
        }


def state_store(cfg, budget_mb: float) -> StateStore:
    """The state store of this run's folder (shared by the clients of a standalone run)."""
    folder = os.path.join(os.path.abspath(cfg.outdir), "fedpa_state")
    if folder not in _STORES:
        _STORES[folder] = StateStore(folder, int(budget_mb * 2**20) if budget_mb > 0 else None)
    return _STORES[folder]
