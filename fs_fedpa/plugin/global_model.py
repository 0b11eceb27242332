"""The global adapter as the server holds, checkpoints and sends it (:class:`GlobalModel`, a collaborator of
:class:`~fs_fedpa.plugin.server.FedPAServer`): the global factors (effective, rank R_g), written into the server's
FS model once after every aggregation so that FS's server-side evaluation and checkpoints see them; the shared
tensors; the merges into the base weights (:class:`~fs_fedpa.merge_ledger.MergeLedger`); each client's downlink
message, with its byte count; and the round it sent, which the aggregation reads (:meth:`GlobalModel.round_input`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from fs_fedpa import export, lora
from fs_fedpa.aggregation import RoundInput
from fs_fedpa.lora import Factors
from fs_fedpa.merge_ledger import MergeLedger
from fs_fedpa.methods.base import FederatedMethod
from fs_fedpa.plugin.common import global_init
from fs_fedpa.plugin.payload import encode_factors, encode_merge, encode_tensors, nbytes
from fs_fedpa.state_checks import check_fields, check_global, check_tensors, is_int


class GlobalModel:
    """The global adapter of ``method`` on the server's FS ``model``. ``shared_names``: the trainable non-LoRA
    tensors the clients send and the server averages; ``public_locals``: under client-level DP, the initial values
    of the clients' local tensors (a head), which the server's files hold in place of what its model holds (with
    ``federate.share_local_model`` that is the last client's, trained without DP); empty otherwise.

    ``factors``: (B_g, A_g) per module, starting at Alg. 1 l.2's initialisation; ``down_bytes``: per client, the
    bytes of its last training message (with the merges that rode on evaluation messages since)."""

    def __init__(self, model, method, shared_names: list[str], public_locals: dict[str, Tensor]):
        self.model, self.method, self.shared_names = model, method, shared_names
        self.scaling = lora.Scaling.of(model)
        self.shared: dict[str, Tensor] = {}
        self.keep_shared()
        self.public_locals = public_locals
        self.factors: Factors = global_init(model, method)  # (B_g^(0), A_g^(0)), rank r_g
        self.merges = MergeLedger()  # exact-aggregation methods: merges into the base weights, and who holds them
        self.down_bytes: dict[int, int] = {}
        self.late_down: dict[int, int] = {}  # merge bytes that rode on evaluation messages: next round's downlink
        self.rnd, self.receivers = 0, ()  # the round sent last (open_round)

    @property
    def device(self) -> torch.device:
        return next(iter(self.factors.values()))[0].device

    def install(self, factors: Factors, shared: dict[str, Tensor], merge=None) -> None:
        """Adopt new global factors; write them (raw, rank R_g) and the averaged shared tensors into the model; add
        a method's ``merge`` to the base weights (the server's own, and, with the next messages, the clients')."""
        self.factors = factors
        lora.set_factors(self.model, self.scaling.raw(self.method.expand(factors)))
        if merge:
            self.merges.add(merge, dense=self.method.merge_encoding == "dense")
        if self.merges.merged:
            lora.set_base_offsets(self.model, self.merges.merged)
        if shared:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, value in shared.items():
                    params[name].copy_(value)
            self.keep_shared()

    def adopt(self, done) -> None:
        """Install a round's aggregate (:class:`~fs_fedpa.aggregation.Aggregated`): a client whose stored state was
        lost is sent every merge again, and the new global adapter goes into the model (:meth:`install`), the one
        write of it a round (FS then merges nothing: the aggregator returns it {})."""
        for client in done.lost:
            self.merges.forget(client)
        self.install(done.global_factors, done.shared, done.merge)

    def open_round(self, rnd: int, receivers) -> None:
        """The server sends round ``rnd``'s model to ``receivers``: the round :meth:`round_input` gives."""
        self.rnd, self.receivers = rnd, tuple(sorted(receivers))

    def round_input(self) -> RoundInput:
        """The round being aggregated, as :meth:`open_round` opened it: its receivers, the global factors and shared
        tensors it started from and the bytes each client was sent."""
        return RoundInput(self.rnd, self.receivers, self.factors, dict(self.down_bytes), dict(self.shared))

    def keep_shared(self) -> None:
        """The server's own CPU copy of the shared tensors as its model holds them now (after install or restore):
        the clients may share that model object and load theirs into it."""
        params = dict(self.model.named_parameters())
        self.shared = {n: params[n].detach().cpu().clone() for n in self.shared_names}

    def state_dict(self) -> dict:
        """For a resume point, on the CPU: the effective global factors, the downlink bytes, the merge ledger and
        ``model``, the FS model's state (the shared tensors, e.g. a shared head; under client-level DP the initial
        local tensors, :meth:`with_public_locals`)."""
        return {
            "factors": lora.copy_factors(self.factors, "cpu"),
            "down_bytes": dict(self.down_bytes),
            "merges": self.merges.state_dict(),
            "model": self.with_public_locals(self.model.state_dict()),
        }

    FIELDS = ("factors", "down_bytes", "merges")  # its part of a resume point (``model``: FS's own key beside)

    def check_state(self, state: dict, path: str, rnd: int) -> None:
        """ValueError naming ``path`` and the field ``global_model.<key>`` unless ``state`` (:meth:`state_dict`'s
        dict in the resume point ``path`` of round ``rnd``) fits this run: the global factors the modules of the
        initial ones at a rank from 1 to max(r_g, R_g), dense and finite (:func:`~fs_fedpa.state_checks.check_global`),
        the downlink bytes per client ids, the merges of known modules (:meth:`MergeLedger.check_state`)."""
        at = f"federate.restore_from {path!r}"
        check_fields(state, at, "global_model", self.FIELDS)
        plan = self.method.plan
        check_global(state["factors"], path, self.factors, max(plan.r_g, plan.R_g))
        down = state["down_bytes"]
        if not isinstance(down, dict) or not all(is_int(c) and is_int(b) and b >= 0 for c, b in down.items()):
            raise ValueError(f"{at}: field 'global_model.down_bytes' is {down!r:.100}, not bytes per client id")
        self.merges.check_state(state["merges"], at, "global_model.merges", self.method.shapes)

    def load_state_dict(self, state: dict, path: str) -> None:
        """:meth:`state_dict`'s dict (``model``: FS's checkpoint model state, the LoRA factors aside), checked by
        :meth:`check_state` before; ``path`` is its file."""
        device = self.device
        self.install({n: (B.to(device), A.to(device)) for n, (B, A) in state["factors"].items()}, {})
        self.model.load_state_dict(state["model"], strict=False)
        self.keep_shared()
        self.down_bytes = dict(state["down_bytes"])
        self.merges.load_state_dict(state["merges"], device)
        if self.merges.merged:
            lora.set_base_offsets(self.model, self.merges.merged)

    # ---------------------------------------------------------------------------------- downlink
    def downlink(self, receivers: list[int], training: bool, wire: bool) -> Iterator[tuple[int, dict]]:
        """(client id, payload) for each receiver: its rank-R_i reference, the shared tensors and the merges it
        lacks. ``training``: a round's model message (its bytes are the round's downlink, and the client holds the
        merges from now on); else an evaluation's. ``wire``: tensors as explicit encodings, never pickled."""
        shared = encode_tensors(self.shared, wire)  # the server's copy, as the release and the checkpoint read it
        # Standalone: the receivers of one reference rank share one read-only copy of it (the method's default
        # downlink), so a broadcast to N clients holds one copy per rank, not N (clients never change it in place).
        shared_downlink = not wire and type(self.method).downlink is FederatedMethod.downlink
        copies: dict[int, dict] = {}
        for client_id in receivers:
            R_i = self.method.plan.reference_ranks[client_id - 1]
            if not shared_downlink or R_i not in copies:
                copies[R_i] = encode_factors(self.method.downlink(self.factors, client_id - 1), wire=wire)
            down = copies[R_i] if shared_downlink else copies.pop(R_i)
            # FS's gRPC encoder fails on empty dicts, and rewrites dicts in place: one per receiver
            payload = {"lora": dict(down)} if down else {"zero_reference": 1}
            if shared:
                payload["shared"] = dict(shared)
            merges = self.merges.pending(client_id)
            if merges is not None:
                kind, value = merges
                payload[kind] = encode_merge(value, wire) if kind == "base" else (
                    encode_tensors(value, wire) if wire else dict(value))  # fmt: skip
            if training:
                self.down_bytes[client_id] = nbytes(payload) + self.late_down.pop(client_id, 0)
                self.merges.trained(client_id)
            elif merges is not None:
                late = nbytes({merges[0]: payload[merges[0]]})
                self.late_down[client_id] = self.late_down.get(client_id, 0) + late
            yield client_id, payload

    # ---------------------------------------------------------------------------------- FS's checkpoint
    @torch.no_grad()
    def checkpoint_state(self) -> dict[str, Tensor]:
        """FS's checkpoint ``model`` (its trainable state, named as FS names it) with the global adapter in place of
        whatever the live model holds: the raw global factors at rank R_g, the server's shared tensors and, where
        merges exist, the base weights ``W_0 + merged``. Built beside the live model, which the clients may share
        (``federate.share_local_model``) and which is left as it is; local tensors (a head) are the model's, except
        under client-level DP, where they are :attr:`public_locals`."""
        state = dict(self.model.state_dict())
        key = self._state_keys(state)
        layers = lora.lora_layers(self.model)
        for name, (B, A) in self.scaling.raw(self.method.expand(self.factors)).items():
            weight_B, weight_A = lora.adapter_weights(layers[name])
            state[key[id(weight_B)]] = B.detach().to("cpu", weight_B.dtype, copy=True)
            state[key[id(weight_A)]] = A.detach().to("cpu", weight_A.dtype, copy=True)
        for name, offset in self.merges.merged.items():
            base = layers[name].get_base_layer().weight
            state[key[id(base)]] = lora.offset_base(layers[name], offset, name).cpu()
        params = dict(self.model.named_parameters())
        state.update({key[id(params[n])]: t.detach().to("cpu", copy=True) for n, t in self.shared.items()})
        return self.with_public_locals(state)

    def save_checkpoint(self, path: str, cur_round: int, run: dict) -> None:
        """FS's checkpoint format (``cur_round``, ``model``: :meth:`checkpoint_state`) plus ``fedpa``:
        :meth:`checkpoint_fields` and ``run``, the identity of the run that wrote it."""
        fields = {**self.checkpoint_fields(), "run": dict(run)}
        torch.save({"cur_round": cur_round, "model": self.checkpoint_state(), "fedpa": fields}, path)

    def load_checkpoint(self, path: str) -> int:
        """A checkpoint :meth:`save_checkpoint` wrote for this method and rank plan: its global factors and shared
        tensors installed; returns its ``cur_round``. ValueError naming the file for anything else, and for one with
        merges into the base weights (which clients hold them is in a resume point only: ``federate.restore_from``)."""
        saved = export.read_checkpoint(path)
        section = saved.get("fedpa") if isinstance(saved, dict) else None
        model = saved.get("model") if isinstance(saved, dict) else None
        factors = section.get("global") if isinstance(section, dict) else None
        pairs = isinstance(factors, dict) and all(
            isinstance(f, (tuple, list)) and len(f) == 2 and all(isinstance(t, Tensor) and t.dim() == 2 for t in f)
            for f in factors.values())  # fmt: skip
        if not pairs or not isinstance(model, dict) or not isinstance(saved.get("cur_round"), int):
            raise ValueError(f"{path}: not a checkpoint of an fs_fedpa run (no 'fedpa' section with the global "
                             "factors, 'model' and 'cur_round')")  # fmt: skip
        if why := other_plan(section, self.method):
            raise ValueError(f"{path} {why}")
        want = {n: (B.shape[0], A.shape[1]) for n, (B, A) in self.factors.items()}  # (d, k) per module
        got = {n: (B.shape[0], A.shape[1]) for n, (B, A) in factors.items()}
        if section.get("R_g") != self.method.plan.R_g or got != want:
            raise ValueError(f"{path} holds R_g {section.get('R_g')} and modules (d, k) {got}; its config says R_g "
                             f"{self.method.plan.R_g} and {want}")  # fmt: skip
        if section.get("merged"):
            raise ValueError(f"{path}: holds merges into the base weights; continue such a run from its resume "
                             "point (federate.restore_from)")  # fmt: skip
        # each module's (B, A): dense, of a rank from 1 to R_g, finite; refused naming the file and the module
        # before anything is installed (a rank-0 pair would divide by zero in the scaling, a NaN train on)
        plan = self.method.plan
        check_global(factors, path, self.factors, max(plan.r_g, plan.R_g), at=str(path), field="fedpa.global")
        key, params = self._state_keys(model), dict(self.model.named_parameters())
        shared = {n: model.get(key[id(params[n])]) for n in self.shared_names}
        if bad := [n for n, t in shared.items() if not isinstance(t, Tensor) or t.shape != params[n].shape]:
            raise ValueError(f"{path}: its model state lacks the shared tensors {bad} as this model shapes them")
        check_tensors(shared, path, "model", {n: tuple(t.shape) for n, t in shared.items()})
        device = self.device
        self.install({n: (B.to(device), A.to(device)) for n, (B, A) in factors.items()}, shared)
        return int(saved["cur_round"])

    def checkpoint_fields(self) -> dict:
        """The ``fedpa`` entry of FS's checkpoint: the effective global factors, the merges and the rank plan."""
        plan = self.method.plan
        return {
            "method": self.method.name,
            "global": lora.copy_factors(self.factors, "cpu"),
            "merged": {n: t.cpu() for n, t in self.merges.merged.items()},  # (d, k): what merges added to W_0
            "client_ranks": list(plan.client_ranks),
            "reference_ranks": list(plan.reference_ranks),
            "R_g": plan.R_g,
            "scaling": self.scaling.record(),  # the export checks the config against it
        }

    def with_public_locals(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """``state`` (keys of the model's ``state_dict``) with the local tensors replaced by :attr:`public_locals`
        (client-level DP; unchanged otherwise)."""
        if not self.public_locals:
            return state
        key, params = self._state_keys(state), dict(self.model.named_parameters())
        return {**state, **{key[id(params[n])]: t.clone() for n, t in self.public_locals.items()}}

    def _state_keys(self, state: dict) -> dict[int, str]:
        """id of each parameter -> its key in the model's ``state_dict`` (FS-LLM's AdapterModel names its state by
        the inner model)."""
        root = getattr(self.model, "model", self.model)
        key = {id(p): n for n, p in root.named_parameters()}
        if not set(state) <= set(key.values()):
            key = {id(p): n for n, p in self.model.named_parameters()}
        return key


def other_plan(section: dict, method: FederatedMethod) -> str | None:
    """Why the ``fedpa`` section of a checkpoint (:meth:`GlobalModel.checkpoint_fields`) was not written by
    ``method`` at its rank plan (method, r_i, R_i), or None."""
    plan = method.plan
    saved = section.get("method"), list(section.get("client_ranks") or ()), list(section.get("reference_ranks") or ())
    if saved == (method.name, list(plan.client_ranks), list(plan.reference_ranks)):
        return None
    return (f"was saved by method {saved[0]!r} with ranks r_i {saved[1]}, R_i {saved[2]}; its config says "
            f"{method.name!r} with {list(plan.client_ranks)}, {list(plan.reference_ranks)}")  # fmt: skip
