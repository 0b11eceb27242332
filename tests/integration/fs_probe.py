"""Run one FederatedScope job in this process with spies on the FedPA workers; save what they saw.

Used by the integration tests as ``python -m tests.integration.fs_probe CFG.yaml OUT.pt [opts ...]``
in a subprocess (FS changes process-wide state, e.g. ``torch.set_num_threads(1)``). The spies
only copy what passes through the plugin's own seams; they change nothing:

- ``enter``: per client and round, the factors the model trains from, the ranks it received and, for the methods
  that merge into the base weights, those weights; for Ravan its heads and which of them train;
- ``leave``: per client and round, the factors it keeps (in PEFT's raw scale of its rank r_i, ``B / s_i``, as every
  record of a client's kept factors here: the scale of its model's factors) and the keys/ranks of its upload;
- ``conversions``: per client and round, how many times its factors were converted between spaces (calls of
  ``ClientSpace``'s methods but ``s_i`` and ``penalty_weight``) from the start of its round to its upload;
- ``aggregate``: per round, an independent decode of the uploads, their weights and clients, and
  the global factors the server adopted;
- ``loss_gap``: ``loss_task - loss_batch`` of every training batch (the added alignment term);
- ``personal``: per client and round with a personal phase (FedDPA), its personal factors before and after, and the
  model as that phase trains it (LoRA factors, base weights, PEFT scaling) with the reference it received;
- ``final``: every client's kept factors, base offset, personal adapter and local tensors, as each leaves them at
  its finish message before letting them go, the server's global factors and merges at the end, the clients that
  still hold any state after the run (``held_after_finish``), which clients' trainers still hold an optimizer
  (``optimizers_kept``), and how many distinct config, parameter-name and rank-plan objects the clients hold
  (``distinct``);
- ``sent``: per client and round, the sample size and the factors of its upload (``module -> {part: tensor}``) as
  the client made it, and its stats;
- ``e_agg_calls``: how many times the server computed E_agg of a module (its aggregate diagnostics).

``FS_PROBE_DAMAGE_SPILL=1`` cuts short the third file the client state store spills (a disk fault); a list of kinds
(``truncate,zero_link,grow,pickle,swap,link_other,rmtree``) damages every fourth file from the third on, each kind in
turn (:func:`_damage`).

``FS_PROBE_NAN_LOCAL="client:round,..."`` puts a NaN into that client's live factors at the end of that round's
training, as a diverging step would.

``FS_PROBE_CRASH_AFTER_RESUME=t`` ends the process (``os._exit(137)``, no clean-up, as a kill would) once the
server's resume point of round t is written.

Deliberate faults, for the reliability and fault-table tests: ``FS_PROBE_CORRUPT="client:round:name,..."`` makes
that client send, in that round, what the fault ``name`` of ``tests.integration.fault_cases.FAULTS`` makes of its
message (a NaN, a wrong shape, a pickle that creates the file ``FS_PROBE_CANARY`` if anyone unpickles it, a bad
sample size, ...), after the spies recorded the honest one; ``duplicate`` and ``extra sender 99`` send the honest
message and then a second copy (from the same sender, or claiming sender id 99). The aggregation spy records None
for what it cannot decode.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import sys

import torch


def _copy(factors):
    return {n: (B.detach().cpu().clone(), A.detach().cpu().clone()) for n, (B, A) in factors.items()}


def _raw(client_model, factors):
    """A client's kept (applied) factors in PEFT's raw scale of its rank r_i, ``B / s_i``: the tests compare them with
    its model's factors (computed here, not by the plugin's conversions, which ``conversions`` counts)."""
    s_i = client_model.space.s_i
    return {n: (B.detach().cpu() / s_i(n), A.detach().cpu().clone()) for n, (B, A) in factors.items()}


def _heads(model) -> dict:
    """Ravan's heads as the model trains them: ``heads`` (cores, scales) and ``trainable`` (which have gradients)."""
    from fs_fedpa import lora

    layers = lora.lora_layers(model)
    return {
        "heads": _copy(lora.get_heads(model)),
        "trainable": {
            n: [h for h, c in enumerate(layer.fedpa_heads.cores) if c.requires_grad] for n, layer in layers.items()
        },  # fmt: skip
    }


def _faults() -> dict[tuple[int, int], str]:
    spec = os.environ.get("FS_PROBE_CORRUPT", "")
    return {(int(c), int(r)): name for c, r, name in (f.split(":", 2) for f in spec.split(",") if f)}


def main(cfg_file: str, out: str, opts: list[str]) -> None:
    from federatedscope.core.auxiliaries.data_builder import get_data
    from federatedscope.core.auxiliaries.logging import update_logger
    from federatedscope.core.auxiliaries.runner_builder import get_runner
    from federatedscope.core.auxiliaries.utils import setup_seed
    from federatedscope.core.auxiliaries.worker_builder import get_client_cls, get_server_cls
    from federatedscope.core.configs.config import global_cfg

    from fs_fedpa import aggregation as records_mod
    from fs_fedpa import lora
    from fs_fedpa.plugin import aggregator as aggregator_mod
    from fs_fedpa.plugin import client as client_mod
    from fs_fedpa.plugin import client_round as round_mod
    from fs_fedpa.plugin import evaluation as evaluation_mod
    from fs_fedpa.plugin.payload import decode_factors, decode_parts, from_wire
    from tests.integration.fault_cases import corrupt

    record = {"enter": [], "leave": [], "aggregate": [], "loss_gap": [], "sent": [], "conversions": []}
    converted = [0]  # calls of the client space's conversions so far

    def counted(fn):
        def conversion(*args, **kwargs):
            converted[0] += 1
            return fn(*args, **kwargs)

        return conversion

    for name, fn in list(vars(lora.ClientSpace).items()):
        if callable(fn) and not name.startswith("_") and name not in ("s_i", "penalty_weight"):
            setattr(lora.ClientSpace, name, counted(fn))
    if damages := _damages(os.environ.get("FS_PROBE_DAMAGE_SPILL", "")):
        from fs_fedpa.state_store import StateStore

        write, written = StateStore._write, []

        def damaging_write(self, client, state):
            write(self, client, state)
            written.append(client)
            if (kind := damages.get(len(written))) is not None:
                _damage(self._path(client), kind)

        StateStore._write = damaging_write
    if crash := os.environ.get("FS_PROBE_CRASH_AFTER_RESUME"):
        from fs_fedpa.plugin.resume_fs import ServerResume

        write_point = ServerResume.write

        def write_then_crash(self, rnd, *args, **kwargs):
            path = write_point(self, rnd, *args, **kwargs)
            if rnd == int(crash):
                sys.stdout.flush()
                os._exit(137)
            return path

        ServerResume.write = write_then_crash
    faults = _faults()
    poison_local = {
        tuple(map(int, f.split(":"))) for f in os.environ.get("FS_PROBE_NAN_LOCAL", "").split(",") if f
    }  # client:round
    Client, Aggregator = client_mod.FedPAClient, aggregator_mod.FedPAAggregator

    Round = round_mod.ClientRound
    orig_init, orig_enter, orig_leave = Client.__init__, Round.enter, Round.leave
    orig_personal = Round.train_personal
    record["personal"] = []
    orig_aggregate = Aggregator.aggregate

    def init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        if self._cfg is not None:
            self.evaluation.splits = lambda: evaluate_splits(self)

            def gap(ctx):
                record["loss_gap"].append(float((ctx.loss_task - ctx.loss_batch).detach()))

            self.trainer.register_hook_in_train(new_hook=gap, trigger="on_batch_forward")
            send = self.outbox.deliver  # below the client's own check of what it sends: faults of the wire

            def spy_send(message):
                if message.msg_type == "model_para":
                    size, upload = message.content
                    record["sent"].append(
                        {"client": message.sender, "round": message.state, "size": float(size),
                         "parts": {n: dict(p) for n, p in decode_parts(upload["lora"]).items()},
                         "stats": dict(upload.get("stats", {}))}
                    )  # fmt: skip
                    name = faults.get((message.sender, message.state))
                    if name in ("duplicate", "extra sender 99"):  # the honest message, then a second one
                        send(message)
                        message = copy.copy(message)
                        message.sender = 99 if name == "extra sender 99" else message.sender
                    elif name is not None:
                        message.content = corrupt(name, size, upload)
                return send(message)

            self.outbox.deliver = spy_send

    def enter(self, payload, rnd):  # a ClientRound's
        self.converted_before = converted[0]
        orig_enter(self, payload, rnd)
        received = decode_factors(payload.get("lora", {}))
        model = self.client_model.model
        layers = lora.lora_layers(model) if self.client_model.moves_base else {}
        record["enter"].append(
            {
                "client": self.client_model.client_id,
                "round": rnd,
                "start": _copy(lora.get_factors(model)),
                "received_ranks": sorted({B.shape[1] for B, _ in received.values()}),
                "received": _copy(received) if self.method.folds or not self.method.state_is_factors else {},
                "base": {n: layer.get_base_layer().weight.detach().cpu().clone() for n, layer in layers.items()},
                **({} if self.method.state_is_factors else _heads(model)),
            }
        )

    def train_personal(self, received, payload, rnd):
        before = None if self.kept.personal is None else _raw(self.client_model, self.kept.personal)
        seen = {}
        train = self.trainer.train

        def spy_train(*args, **kwargs):  # the model as the personal phase trains it
            layers = lora.lora_layers(self.client_model.model)
            seen["start"] = _copy(lora.get_factors(self.client_model.model))
            seen["base"] = {n: layer.get_base_layer().weight.detach().cpu().clone() for n, layer in layers.items()}
            seen["scaling"] = {n: next(iter(layer.scaling.values())) for n, layer in layers.items()}
            return train(*args, **kwargs)

        self.trainer.train = spy_train
        try:
            orig_personal(self, received, payload, rnd)
        finally:
            self.trainer.train = train
        if seen:
            entry = {"client": self.client_model.client_id, "round": rnd, "before": before,
                     "after": _raw(self.client_model, self.kept.personal)}  # fmt: skip
            record["personal"].append({**entry, **seen, "received": _raw(self.client_model, received)})

    def leave(self, rnd, systems=None):
        if (self.client_model.client_id, rnd) in poison_local:  # a training step gone wrong: NaN in the live factors
            B = next(iter(self.alignment.live.values()))[0]
            with torch.no_grad():
                B[0, 0] = float("nan")
        upload = orig_leave(self, rnd, systems)
        client = self.client_model.client_id
        record["conversions"].append({"client": client, "round": rnd, "n": converted[0] - self.converted_before})
        record["leave"].append(
            {
                "client": client,
                "round": rnd,
                "end": _raw(self.client_model, self.kept.factors),
                "local": {n: t.detach().cpu().clone() for n, t in self.kept.local.items()},
                "upload_keys": sorted(upload["lora"]) + sorted(upload.get("shared", {})),
                "upload_ranks": sorted({_rank(p) for p in decode_parts(upload["lora"]).values()}),
            }
        )
        return upload

    def aggregate(self, agg_info):
        # a faulty message may not be a (size, content) pair, or hold objects that raise when touched
        pairs = [
            m if isinstance(m, (tuple, list)) and len(m) == 2 else (None, None) for m in agg_info["client_feedback"]
        ]
        weights = [n if isinstance(n, (int, float)) else None for n, _ in pairs]
        clients = [c for c, _ in agg_info["staleness"]]
        start = self.global_model.round_input()  # uploads as the server completes them (a method may send one only)
        uploads = []
        for c, (_, content) in zip(clients, pairs):
            try:
                parts = decode_parts(content["lora"])
                uploads.append(_copy(self.method.complete_upload(parts, start.global_factors, c - 1, start.rnd)))
            except Exception:  # a fault of the table: the server's own checks say why
                uploads.append(None)
        shared = []  # each upload's shared (non-LoRA) tensors, as sent
        for _, content in pairs:
            try:
                shared.append({k: from_wire(v) if isinstance(v, str) else v.detach().clone()
                               for k, v in content["shared"].items()})  # fmt: skip
            except Exception:
                shared.append(None)
        installed, model = [], self.global_model

        class Watched:  # the server's GlobalModel, recording what the aggregator installs into it
            def adopt(self, done):
                installed.append(done)
                return model.adopt(done)

            def __getattr__(self, name):
                return getattr(model, name)

        self.global_model = Watched()
        try:
            result = orig_aggregate(self, agg_info)
        finally:
            self.global_model = model
        done = installed[0] if installed else None
        record["aggregate"].append(
            {
                "round": start.rnd,
                "uploads": uploads,
                "weights": weights,
                "clients": clients,
                "global": _copy(done.global_factors if done is not None else start.global_factors),
                "global_start": _copy(start.global_factors),
                "shared_uploads": shared,
                "shared_start": {k: v.clone() for k, v in start.shared.items()},
                "shared": {k: v.clone() for k, v in done.shared.items()} if done is not None else {},
            }
        )
        return result

    orig_splits = evaluation_mod.Evaluation.splits
    record["evaluate"] = []

    def evaluate_splits(client):  # the model each evaluation sees: the paper protocol's first, then the own factors'
        layers = lora.lora_layers(client.model) if client.client_model.moves_base else {}
        record["evaluate"].append(
            {
                "client": client.ID,
                "round": client.state,
                "factors": _copy(lora.get_factors(client.model)) if client.method.state_is_factors else {},
                "base": {n: layer.get_base_layer().weight.detach().cpu().clone() for n, layer in layers.items()},
            }
        )
        return orig_splits(client.evaluation)

    orig_mix = evaluation_mod.Evaluation.instance_mix
    record["instance"] = []

    def instance_mix(self, split, device, rnd, client):
        undo = orig_mix(self, split, device, rnd, client)

        def spy_undo():
            undo()
            g = torch.cat(self.instance_weights) if self.instance_weights else torch.zeros(0)
            record["instance"].append({"client": client, "round": rnd, "split": split, "g": g})

        return spy_undo

    evaluation_mod.Evaluation.instance_mix = instance_mix
    record["e_agg_calls"] = 0
    aggregation_error = records_mod.aggregation_error

    def counted_aggregation_error(*args, **kwargs):  # the server's diagnostics: computed only when written
        record["e_agg_calls"] += 1
        return aggregation_error(*args, **kwargs)

    records_mod.aggregation_error = counted_aggregation_error
    Client.__init__, Round.enter, Round.leave, Round.train_personal = init, enter, leave, train_personal
    Aggregator.aggregate = aggregate
    ends, orig_finish = {}, Client.callback_funcs_for_finish

    def finish(self, message):  # each client's end state, as the run leaves it, before the client lets it go
        def snapshot():
            ends[self.ID] = {
                "factors": _raw(self.client_model, self.kept.factors) if self.kept.factors is not None else None,
                "offsets": {n: t.cpu().clone() for n, t in self.kept.base_offset.items()},
                "personal": _raw(self.client_model, self.kept.personal) if self.kept.personal is not None else None,
                "local": {n: t.cpu().clone() for n, t in self.kept.local.items()},
            }

        release = self.kept.release

        def capture():
            snapshot()
            release()

        self.kept.release = capture
        try:
            return orig_finish(self, message)
        finally:
            del self.kept.release
            if self.ID not in ends:  # a client that never lets its state go: held_after_finish names it
                snapshot()

    Client.callback_funcs_for_finish = finish

    cfg = global_cfg.clone()
    cfg.merge_from_file(cfg_file)
    cfg.merge_from_list(opts)
    update_logger(cfg, clear_before_add=True)
    setup_seed(cfg.seed)
    data, modified = get_data(config=cfg.clone(), client_cfgs=None)
    cfg.merge_from_other_cfg(modified)
    cfg.freeze()
    runner = get_runner(
        data=data,
        server_class=get_server_cls(cfg),
        client_class=get_client_cls(cfg),
        config=cfg.clone(),
        client_configs=None,
    )
    runner.run()
    record["final"] = {
        "clients": {cid: e["factors"] for cid, e in ends.items() if e["factors"] is not None},
        "global": _copy(runner.server.globals.factors),
        "merged": {n: t.cpu().clone() for n, t in runner.server.globals.merges.merged.items()},
        "offsets": {cid: e["offsets"] for cid, e in ends.items()},
        "personal": {cid: e["personal"] for cid, e in ends.items() if e["personal"] is not None},
        "local": {cid: e["local"] for cid, e in ends.items()},
        "finished": sorted(ends),
        "client_ids": sorted(runner.client),
        "held_after_finish": sorted(
            cid
            for cid, c in runner.client.items()
            if c.kept.factors is not None or c.kept.personal is not None or c.kept.local or c.kept.base_offset
        ),
        "outdir": cfg.outdir,
        "optimizers_kept": sorted(
            cid for cid, c in runner.client.items() if getattr(c.trainer.ctx, "optimizer", None) is not None
        ),
        # FS's own sizing of each client's model (Client.__init__), which fs_patches.sized_once computes once
        "model_sizes": {cid: c.model_size for cid, c in runner.client.items()},
        "model_size_fs": {cid: _fs_model_size(c.model) for cid, c in runner.client.items()},
        "distinct": {  # how many objects the clients hold of what FS and the method build alike for each
            "config": len({id(c._cfg) for c in runner.client.values()}),
            "trainer config": len({id(c.trainer.ctx.cfg) for c in runner.client.values()}),
            "names": len({id(c.trainer.ctx.trainable_para_names) for c in runner.client.values()}),
            "plan": len({id(c.method.plan) for c in runner.client.values()}),
        },
    }
    torch.save(record, out)


def _fs_model_size(model) -> float:
    """FS's Client.__init__ sizing of a model, as FS writes it (1.0 where the model cannot be pickled)."""
    try:
        return sys.getsizeof(pickle.dumps(model)) / 1024.0 * 8.0
    except Exception:
        return 1.0


def _damages(spec: str) -> dict[int, str]:
    """``FS_PROBE_DAMAGE_SPILL``: ``1`` cuts short the 3rd file written; ``kind,kind,...`` damages the 3rd, 7th,
    11th, ... file written with each kind of :func:`_damage` in turn."""
    if spec in ("", "0"):
        return {}
    kinds = ["truncate"] if spec == "1" else spec.split(",")
    return {3 + 4 * i: kind for i, kind in enumerate(kinds)}


def _damage(path, kind: str) -> None:
    """What a disk fault or another process could do to a spilled client's file just after it was written."""
    others = sorted(p for p in path.parent.glob("client_*.safetensors") if p != path)
    if kind == "truncate":
        path.write_bytes(path.read_bytes()[:40])
    elif kind == "zero_link":
        path.unlink()
        path.symlink_to("/dev/zero")
    elif kind == "grow":
        os.truncate(path, 20 * 2**30)  # sparse: no disk is used
    elif kind == "pickle":
        data = path.read_bytes()
        torch.save({"x": torch.zeros(len(data) // 4)}, path)
    elif kind == "swap" and others:
        tmp = path.with_suffix(".swap")
        os.replace(path, tmp)
        os.replace(others[0], path)
        os.replace(tmp, others[0])
    elif kind == "link_other" and others:
        path.unlink()
        path.symlink_to(others[0])
    elif kind == "rmtree":
        shutil.rmtree(path.parent)
    else:
        raise ValueError(f"FS_PROBE_DAMAGE_SPILL: no damage {kind!r} (or no other file to use)")


def _rank(parts) -> int:
    return parts["B"].shape[1] if "B" in parts else parts["A"].shape[0]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
