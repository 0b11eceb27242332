"""What a client keeps across rounds (:class:`ClientState`, a collaborator of
:class:`~fs_fedpa.plugin.client.FedPAClient`), parked in the run's :class:`~fs_fedpa.state_store.StateStore`
(host memory, or disk beyond ``fedpa.store.state_budget_mb``) after each message and brought back before the next."""

from __future__ import annotations

import logging
import os

import torch
from torch import Tensor

from fs_fedpa import lora
from fs_fedpa.core.moments import KeptMoments
from fs_fedpa.lora import Factors
from fs_fedpa.methods.base import FederatedMethod
from fs_fedpa.state_checks import check_finite, check_int, check_pairs, check_tensor, check_tensors
from fs_fedpa.state_store import SpillError, StateStore, flatten, unflatten

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only
_STORES: dict[str, StateStore] = {}  # one per run folder: the clients of a standalone run share its budget
PARKED_PAIRS = {"factors": "factors", "personal": "personal", "fold": "fold", "received": "last_received"}


class ClientState:
    """One client's state, its factors applied (``(s_i B_i, A_i)``, the uploads' space, which
    :class:`fs_fedpa.lora.ClientSpace` converts into and out of the model):

    - ``factors``: its own ``(B_i, A_i)`` per module, kept across rounds (None until it first trains);
    - ``local``: its local tensors (``personalization.local_param``, e.g. the head), which never leave it;
    - ``base_offset``: per module the (d, k) sum of the merges it received (exact-aggregation methods);
    - ``personal``: a personal adapter that is never sent (FedDPA); ``fold``: the base part of the model it trained
      last (Fed-PLoRA's undrawn modules); ``last_received``: its last evaluation's reference (kept for an export);
    - ``moments``: its optimizer's state at the end of its last routine (``fedpa.keep_moments``; else empty);
    - ``received``: this round's reference (never parked); ``rounds_trained`` and ``last_trained`` (the last round
      it trained), which its resume files carry;
    - ``lost``: its parked state could not be read back, so it restarts from the next reference; ``lost_this_round``
      and ``lost_unreported`` carry that into the round's upload.

    Its invariants, which only its own transitions change (the other modules call them and read the fields):

    - **local factor preservation**: ``factors`` change only by :meth:`keep` (the end of a round it trained; where
      the training diverged, factors restarted from the round's reference), by :meth:`restart` (its stored state was
      lost) and by :meth:`draw` (a client that never trained; :meth:`forget_drawn` drops them again after an
      evaluation). Nothing the server sends replaces them; ``local`` likewise, from :meth:`start` on;
    - ``rounds_trained`` counts the calls of :meth:`keep`, ``last_trained`` is the round of the last one;
    - a lost state is reported exactly once: :meth:`restart` marks it unreported, and :meth:`open_round` moves that
      mark into ``lost_this_round``, the round's upload;
    - between messages the tensors live in ``store`` (:meth:`park`) and none of them on the model's device."""

    def __init__(self, store: StateStore, keep_received: bool):
        self.store, self.keep_received = store, keep_received
        self.factors: Factors | None = None
        self.local: dict[str, Tensor] = {}
        self.base_offset: dict[str, Tensor] = {}
        self.personal: Factors | None = None
        self.fold: Factors | None = None
        self.last_received: Factors | None = None
        self.received: Factors = {}
        self.moments = KeptMoments()
        self.rounds_trained, self.last_trained = 0, None
        self.parked = False
        self.lost = self.lost_this_round = self.lost_unreported = False

    # ---------------------------------------------------------------------------------- transitions
    def start(self, local: dict[str, Tensor]) -> None:
        """At set-up: its local tensors as the model holds them before any round."""
        self.local = local

    def draw(self, initial) -> bool:
        """Alg. 1 l.4 where it has no factors and its state was not lost: ``initial()``'s factors. True if drawn."""
        if self.factors is None and not self.lost:
            self.factors = initial()
            return True
        return False

    def forget_drawn(self) -> None:
        """Drop factors :meth:`draw` gave a client that never trained (any worker can draw them again)."""
        self.factors = None

    def stand_in(self, initial: Factors) -> None:
        """Its stored state was lost (:attr:`lost`): until :meth:`restart`, ``initial`` stands for its factors (the
        modules and ranks a reference is completed to)."""
        self.factors = initial

    def restart(self, received: Factors, factors: Factors) -> None:
        """Its stored state was lost: it starts again from ``factors`` built on the reference ``received`` of this
        round, and the loss is reported with its next upload (:meth:`open_round`)."""
        self.received, self.factors = received, factors
        self.lost, self.lost_unreported = False, True

    def open_round(self, received: Factors, fold: Factors | None) -> None:
        """A round it trains starts: its reference, the base part it trains with (Fed-PLoRA), and a loss not yet
        reported is this round's (its upload says so, and the server sends it every merge again)."""
        self.lost_this_round, self.lost_unreported = self.lost_unreported, False
        self.received, self.fold = received, fold

    def keep_personal(self, personal: Factors, local: dict[str, Tensor]) -> None:
        """The end of a personal phase (FedDPA): its personal adapter and local tensors as trained."""
        self.personal, self.local = personal, local

    def keep(self, factors: Factors, local: dict[str, Tensor], rnd: int) -> None:
        """The end of round ``rnd``, which it trained: its own factors and local tensors as trained (local factor
        preservation)."""
        self.factors, self.local = factors, local
        self.rounds_trained, self.last_trained = self.rounds_trained + 1, rnd

    def evaluated(self, received: Factors) -> None:
        """An evaluation's reference, what an export at the end of the run evaluates."""
        self.last_received = received

    def merge(self, name: str, increment: Tensor) -> None:
        """One merge the server added to the base weights of module ``name``, added to its base offset."""
        offsets = self.base_offset
        offsets[name] = offsets[name] + increment if name in offsets else increment

    def replace_merges(self, total: dict[str, Tensor]) -> None:
        """The sum of every merge so far (it lacked more than the newest), in place of its base offset."""
        self.base_offset = dict(total)

    def park(self, client: int) -> None:
        """After each message: what client ``client`` keeps goes to the store, and nothing of it, nor of the round's
        reference, stays on the model's device."""
        parts = {"factors": self.factors, "local": self.local, "base_offset": self.base_offset,
                 "personal": self.personal, "fold": self.fold, "moments": self.moments.tensors}  # fmt: skip
        if self.keep_received:
            parts["received"] = self.last_received
        self.store.put(client, flatten(parts))
        self.parked = True
        self.release()

    def release(self) -> None:
        """Drop the references to the state and to the round's reference (parked, or the run is over)."""
        self.factors = self.personal = self.fold = self.last_received = None
        self.local, self.base_offset, self.received = {}, {}, {}
        self.moments.clear()

    def unpark(self, client: int, device: torch.device) -> None:
        """Before each message: the state of client ``client`` from the store onto ``device``. A stored state that
        cannot be read back is this client's loss alone: it is logged, :attr:`lost` is set, and the client restarts
        from the reference it receives, with the initial local tensors (docs/errors.md)."""
        if not self.parked:
            return
        self.parked = False
        try:
            flat = self.store.get(client) or {}
        except SpillError as exc:
            logger.warning(f"[fedpa] {exc}; client #{client} restarts from the global reference it receives and "
                           "its initial local tensors")  # fmt: skip
            flat, self.lost = flatten({"local": self.store.initial_local}), True
        parts = unflatten(flat)
        for part, name in PARKED_PAIRS.items():
            setattr(self, name, _on(parts[part], device) if part in parts else None)
        self.local = {n: t.to(device) for n, t in parts.get("local", {}).items()}
        self.base_offset = {n: t.to(device) for n, t in parts.get("base_offset", {}).items()}
        self.moments.load_state_dict(parts.get("moments", {}))

    def state_dict(self) -> dict:
        """Everything kept across rounds (applied factors, local tensors, merges, personal adapter, the round's fold)
        on the CPU, and the rounds it trained: what its resume files hold beside whose they are."""
        return {
            "factors": lora.copy_factors(self.factors, "cpu"),
            "local": {n: t.detach().cpu().clone() for n, t in self.local.items()},
            "base_offset": {n: t.cpu() for n, t in self.base_offset.items()},
            "personal": lora.copy_factors(self.personal, "cpu") if self.personal is not None else {},
            "fold": lora.copy_factors(self.fold or {}, "cpu"),  # what its own model's evaluation adds to the base
            "rounds_trained": self.rounds_trained,
            **({"moments": self.moments.state_dict()} if self.moments.tensors else {}),
        }

    @staticmethod
    def check_state(saved: dict, path, rnd: int, *, method, initial: Factors, local: dict[str, Tensor]) -> None:
        """ValueError naming ``path`` and the field unless ``saved`` holds a state of this client after round ``rnd``:
        ``rounds_trained`` an int that fits, the factors of the shapes of ``initial`` (its initial factors; a method
        that prunes, as HetLoRA does, may keep a lower rank), the local tensors those of ``local``, the base offsets
        (d, k) of known modules, and every tensor dense, floating point and finite."""
        at = f"resume file {path}"
        check_int(saved, at, "rounds_trained", 1, rnd + 1)
        prunes = type(method).end_round is not FederatedMethod.end_round  # it may keep fewer ranks than it started
        shapes = {n: (tuple(B.shape), tuple(A.shape)) for n, (B, A) in initial.items()}
        check_pairs(saved.get("factors"), at, "factors", shapes, max_rank=None, lower_rank=prunes)
        if saved.get("personal"):  # a personal adapter (FedDPA) has the client's rank
            check_pairs(saved["personal"], at, "personal", shapes, max_rank=None, lower_rank=False)
        if fold := saved.get("fold"):  # Fed-PLoRA's undrawn modules of the round, of a reference's rank
            # the modules it names, where known: an unknown one is refused by name
            drawn = {n: shapes[n] for n in fold if n in shapes} if isinstance(fold, dict) else shapes
            check_pairs(fold, at, "fold", drawn, max_rank=method.plan.R_g, lower_rank=True)
        check_tensors(saved.get("local"), at, "local", {n: tuple(t.shape) for n, t in local.items()})
        check_tensors(saved.get("base_offset", {}), at, "base_offset", method.shapes, exact=False)
        moments = saved.get("moments", {})
        if not isinstance(moments, dict):
            raise ValueError(f"{at}: field 'moments' is a {type(moments).__name__}, not a mapping of names to tensors")
        for name, t in moments.items():
            check_tensor(t, f"{at}: field 'moments[{name!r}]'")
            check_finite(t, f"{at}: field 'moments[{name!r}]'")

    def load_state_dict(self, saved: dict, device: torch.device) -> None:
        """A resume file's state (:meth:`state_dict`'s keys and ``round``, checked by :meth:`check_state`) onto
        ``device``."""
        self.factors = _on(saved["factors"], device)
        self.local = {n: t.to(device) for n, t in saved["local"].items()}
        self.base_offset = {n: t.to(device) for n, t in saved.get("base_offset", {}).items()}
        self.personal = _on(saved.get("personal", {}), device) or None
        self.fold = _on(saved.get("fold", {}), device) or None
        self.moments.load_state_dict(saved.get("moments", {}))
        self.rounds_trained = saved["rounds_trained"]
        self.last_trained = saved["round"]  # a client writes its file in the round it trains


def _on(factors: Factors, device: torch.device) -> Factors:
    return {n: (B.to(device), A.to(device)) for n, (B, A) in factors.items()}


def state_store(cfg, budget_mb: float) -> StateStore:
    """The state store of this run's folder (shared by the clients of a standalone run)."""
    folder = os.path.join(os.path.abspath(cfg.outdir), "fedpa_state")
    if folder not in _STORES:
        _STORES[folder] = StateStore(folder, int(budget_mb * 2**20) if budget_mb > 0 else None)
    return _STORES[folder]
