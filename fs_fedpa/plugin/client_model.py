"""FS's model as one client sees it (:class:`ClientModel`, a collaborator of
:class:`~fs_fedpa.plugin.client.FedPAClient`): what a server message's reference and merges are (applied factors,
the client's one space, as they arrive), and what goes into the model before a routine (factors through the method
and the client's space, local and shared tensors, the base weights with the client's merges). Training and
evaluation both use it; the round is
:class:`~fs_fedpa.plugin.client_round.ClientRound`."""

from __future__ import annotations

import torch
from torch import Tensor

from fs_fedpa import lora
from fs_fedpa.core.ranks import truncate_factors
from fs_fedpa.lora import Factors
from fs_fedpa.plugin.client_state import ClientState
from fs_fedpa.plugin.common import global_init
from fs_fedpa.plugin.payload import decode_factors, decode_merge, decode_tensors


class ClientModel:
    """Client ``index`` (0-based) of ``method``, with ``kept`` its state, on FS's ``model`` and ``trainer``.

    ``space`` converts its applied factors into and out of the model (:class:`fs_fedpa.lora.ClientSpace` at rank
    r_i); :meth:`bind` sets it and the index when they are known (distributed mode: when the client has joined)."""

    def __init__(self, model, trainer, method, kept: ClientState):
        self.model, self.trainer, self.method, self.kept = model, trainer, method, kept
        # whether the method ever changes the model's base weights (merges, folds or a personal phase): the rule that
        # also refuses a quantized base, FederatedMethod.writes_base
        self.moves_base = bool(method.writes_base())
        self.index = -1
        self.space: lora.ClientSpace | lora.UnitSpace = lora.UnitSpace()

    def bind(self, index: int, space) -> None:
        self.index, self.space = index, space

    @property
    def client_id(self) -> int:
        """FS's id of the client (its index + 1)."""
        return self.index + 1

    @property
    def device(self) -> torch.device:
        """Where the client trains and evaluates: its trainer's device. Not the model's device between two routines:
        with ``federate.share_local_model False`` FS moves the model there when a routine starts and back to the
        host when it ends (``discharge_model``), so a message finds the model on the host."""
        device = getattr(getattr(self.trainer, "ctx", None), "device", None)
        if device is None:
            return next(iter(lora.get_factors(self.model).values()))[0].device
        return torch.device(device)

    def snapshot(self, rnd: int) -> dict:
        """Everything the client keeps across rounds (applied factors, local tensors), on the CPU, with round
        ``rnd``, its id and rank r_i, and the space of its factors (``"space": "applied"``: ``(s_i B_i, A_i)``)."""
        rank = self.method.plan.client_ranks[self.index]
        return {"round": rnd, "client": self.client_id, "rank": rank, "space": "applied", **self.kept.state_dict()}

    # ------------------------------------------------------------------------------------ its factors
    def initial_factors(self) -> Factors:
        """Alg. 1 l.4 from the global initialisation that server and clients draw from one seed (drawn on the host,
        then put on the client's device, like the factors it keeps)."""
        device = self.device
        initial = self.method.client_init(global_init(self.model, self.method), self.index)
        return {n: (B.to(device), A.to(device)) for n, (B, A) in initial.items()}

    def restart_factors(self, rnd: int, received: Factors) -> Factors:
        """Rank-r_i factors whose product is the reference ``received`` in round ``rnd``: its R_i columns/rows, then
        zero columns of B with the rows of the client's initial A (so the extra rank can still learn)."""
        if self.method.folds or not self.method.state_is_factors:  # the round's start from what it received
            return self.method.start_round(received, self.kept.factors, self.index, rnd)
        r_i, initial = self.method.plan.client_ranks[self.index], self.initial_factors()
        out = {}
        for name, (B, A) in received.items():
            B_r, A_r = truncate_factors(B, A, r_i)
            R = min(B.shape[1], r_i)
            A_r[R:] = initial[name][1][R:].to(A_r)
            out[name] = (B_r, A_r)
        return out

    def own_and_received(self, payload: dict, rnd: int) -> Factors:
        """The reference of ``payload`` (:meth:`receive`), with the client's own factors ready beside it: those it
        kept or, if its stored state could not be read back (:meth:`ClientState.unpark`), factors restarted from that
        reference (training and evaluation alike, whatever the diagnostics)."""
        kept = self.kept
        lost = kept.lost
        if lost:
            kept.stand_in(self.initial_factors())
        received = self.receive(payload)
        if lost:
            kept.restart(received, self.restart_factors(rnd, received))
        return received

    def receive(self, payload: dict) -> Factors:
        """The reference of a server message (applied factors; zero at rank r_i where the method sends none), after
        adding any merge it carries to the client's base offset."""
        # on the client's device, where it computes with it (its own factors, its round's statistics)
        device, kept = self.device, self.kept
        received = {n: (B.to(device), A.to(device)) for n, (B, A) in decode_factors(payload.get("lora", {})).items()}
        for name, (B, A) in kept.factors.items():
            if name not in received:
                received[name] = (torch.zeros_like(B, device=device), torch.zeros_like(A, device=device))
        if "base_total" in payload:  # it lacked more than the newest merge: the sum of all, in place of its own
            kept.replace_merges({n: t.to(device, torch.promote_types(t.dtype, torch.float32)) for n, t in
                                 decode_tensors(payload["base_total"]).items()})  # fmt: skip
        for merge in decode_merge(payload.get("base", {})):  # one by one, as they were merged
            for name, increment in merge.items():
                if name not in kept.factors:
                    raise KeyError(f"the server merged into {name!r}, which is not a LoRA module of this model")
                kept.merge(name, increment.to(device, torch.promote_types(increment.dtype, torch.float32)))
        return received

    # ------------------------------------------------------------------------------------ into the model
    def set_base(self, fold: Factors | None = None) -> None:
        """The model's base weights: W_0 plus the client's merges (another client may have changed a shared model),
        plus the product of ``fold`` (applied factors) for this round's training."""
        if not self.moves_base:
            return
        offsets = dict(self.kept.base_offset)
        for name, (B, A) in (fold or {}).items():
            offsets[name] = offsets[name] + B @ A if name in offsets else B @ A
        lora.set_base_offsets(self.model, offsets)

    def load(self, state: Factors, rnd: int, trainable: bool | tuple[bool, bool] = True,
             reference: Factors | None = None) -> Factors:  # fmt: skip
        """The client's ``state`` (applied factors) into the model, through the method (LoRA factors for most), in
        the round's one conversion into the model (:meth:`fs_fedpa.lora.ClientSpace.into_model`), which also returns
        ``reference`` in the frame of the model's factors (the alignment term's)."""
        raw, reference = self.space.into_model(state, reference)
        self.method.load(self.model, raw, trainable, self.index, rnd)
        return reference

    def trained(self) -> Factors:
        """Copies of the state the model holds after a routine (through the method), as applied factors: the round's
        one conversion out of the model."""
        return self.space.from_model(lora.copy_factors(self.method.read(self.model)))

    def load_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Named non-LoRA tensors (shared or local) into the model's parameters."""
        if not tensors:
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value)

    def load_round_tensors(self, payload: dict) -> None:
        """The shared tensors a server message carries, then the client's own local tensors (these win)."""
        self.load_tensors(decode_tensors(payload.get("shared", {})))
        self.load_tensors(self.kept.local)

    def read_tensors(self, names: list[str]) -> dict[str, Tensor]:
        """Copies of the model's parameters ``names`` (its local tensors after a routine)."""
        params = dict(self.model.named_parameters())
        return {n: params[n].detach().clone() for n in names}
