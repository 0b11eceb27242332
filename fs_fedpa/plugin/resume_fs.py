"""Resume points: what the server writes at the start of every round and the clients after every round they
train (``federate.save_to``), and how a run continues from them (``federate.restore_from``). The file formats and
their checks are in :mod:`fs_fedpa.resume`; :class:`ClientResume` and :class:`ServerResume` are collaborators of
the two workers."""

from __future__ import annotations

import logging
import os
import re

from torch import Tensor

from fs_fedpa import resume
from fs_fedpa.config import FedPAConfig
from fs_fedpa.config_sections import flat_names
from fs_fedpa.plugin.client_state import ClientState
from fs_fedpa.privacy import accounting_settings
from fs_fedpa.state_checks import check_fields, check_mapping

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


class ClientResume:
    """A client's resume files (``federate.save_to``: after every round it trains; the two newest are kept) and its
    restore, once, in a resumed run (``federate.restore_from``). A collaborator of the client: it takes the client's
    :class:`~fs_fedpa.plugin.client_state.ClientState` and id as arguments."""

    def __init__(self, cfg, method):
        save_to, restore_from = cfg.federate.save_to, cfg.federate.restore_from
        self.cfg, self.method = cfg, method
        self.out = resume.server_path(save_to) if save_to else None
        self.pending = restore_from or None  # read at the first message, which names the round
        self.data: dict | None = None  # the client's training set ({"n": size}), set by the client
        self.file_id = resume.new_file_id()  # its files' token: this run's (a restored client keeps its file's)

    def bound(self, local: dict[str, Tensor]) -> int:
        """The most bytes one of this run's client files can be (:func:`fs_fedpa.resume.file_bound`)."""
        R = max(self.method.plan.R_g, *self.method.plan.client_ranks, *self.method.plan.reference_ranks)
        numel = sum(d * k + (d + k) * R for d, k in self.method.shapes.values())
        return resume.file_bound(numel + sum(t.numel() for t in local.values()))

    def check_data(self, client: int, local: dict[str, Tensor]) -> None:
        """At the start of a resumed run: the training set of client ``client`` (:attr:`data`) is the one its
        newest resume file records (a run's data does not change, so any of its files tells), else ValueError naming
        the file; before any round is trained, not at the client's first message."""
        files = resume.client_files(self.pending, client) if self.pending and self.data is not None else {}
        if files:
            path = files[max(files)]
            saved = resume.peek(path, "data", self.bound(local))
            resume.check_data(saved, f"resume file {path}", self.data)

    def write(self, snapshot: dict, client: int, rnd: int) -> None:
        """Client ``client``'s state after round ``rnd`` (``snapshot``: what it keeps, its rounds trained, with round,
        id and rank), when the run has ``federate.save_to``."""
        if self.out is None:
            return
        owner = resume.client_owner(self.cfg, self.method, client)  # whose it is: checked by every restore
        mine = {"file_id": self.file_id, "data": dict(self.data or {"n": 0})}
        resume.save(
            {**snapshot, **owner, **mine, "rng": resume.rng_state()},
            resume.client_path(self.out, client, rnd),
        )
        for _, path in sorted(resume.client_files(self.out, client).items())[:-2]:
            path.unlink(missing_ok=True)

    def restore(self, kept, client: int, rnd: int, initial, device, privacy=None) -> None:
        """Once, in a resumed run: client ``client``'s newest state from before round ``rnd`` into ``kept`` (and its
        ``privacy`` field into its DP policy), if it ever trained. ``initial()``: the client's initial factors, which
        the file's shapes are checked against."""
        if self.pending is None:
            return
        path, self.pending = self.pending, None
        older = {r: p for r, p in resume.client_files(path, client).items() if r < rnd}
        if not older:
            return  # never trained before the resume point: it starts as a new client would
        saved = resume.load(older[max(older)], self.bound(kept.local))
        # the server checked it too; this client checks what it actually reads
        check_client_file(saved, older[max(older)], max(older), cfg=self.cfg, method=self.method, client=client,
                          initial=initial(), local=kept.local, data=self.data)  # fmt: skip
        if privacy is not None:  # checked by the policy before the state is loaded
            privacy.load_state_dict(saved.get("privacy") or {}, f"resume file {older[max(older)]}")
        kept.load_state_dict(saved, device)
        self.file_id = saved["file_id"]  # the run goes on: its later files carry the token the server recorded
        if self.cfg.federate.mode == "distributed":  # its own process: its own random stream
            resume.set_rng_state(saved["rng"])
        logger.info(f"[fedpa] client {client} resumed its state of round {saved['round']}")


class FSResults:
    """FS's own result history on the server (``history_results``, ``best_results``), as a resume point's part."""

    def __init__(self, server):
        self.server = server

    def state_dict(self) -> dict:
        return {"history_results": resume.plain(self.server.history_results),
                "best_results": resume.plain(self.server.best_results)}  # fmt: skip

    def check_state(self, state: dict, path: str, rnd: int) -> None:
        """ValueError naming ``path`` and the field ``fs_results.<key>`` unless both histories are mappings."""
        at = f"federate.restore_from {path!r}"
        check_fields(state, at, "fs_results", ("history_results", "best_results"))
        for key in ("history_results", "best_results"):
            check_mapping(state[key], at, f"fs_results.{key}")

    def load_state_dict(self, state: dict, path: str) -> None:
        self.server.history_results, self.server.best_results = state["history_results"], state["best_results"]


class ServerResume:
    """The server's resume points (a collaborator of the server): what it writes at the start of every round
    (:meth:`write`, given the round and the server's collaborators) and what it reads back into them in a resumed
    run (:meth:`restore`), checked against this run's method, ranks, settings and every client's
    file before any training."""

    def __init__(self, cfg, method):
        self.cfg, self.method = cfg, method
        self.seen: dict[int, tuple[int, str]] = {}  # client -> (round, file_id) of its newest file seen
        self.model_numel = 0  # the server model's elements (its state), which bound its resume point's size

    def settings(self) -> dict:
        """The keys that change a run's result (recorded in every client file) and those its privacy accounting
        depends on (:func:`fs_fedpa.privacy.accounting_settings`), compared when it resumes."""
        return {**resume.result_settings(self.cfg, self.method), **accounting_settings(self.cfg)}

    def write(self, rnd: int, parts: dict) -> str:
        """Everything the server needs to continue at round ``rnd`` (see :mod:`fs_fedpa.resume`): ``parts``, the
        server's collaborators by their names in :data:`fs_fedpa.resume.PARTS`, each saved by its ``state_dict()``.
        FS's checkpoint keys beside: ``cur_round`` and ``model``, FS's state without the LoRA factors (which the
        global model's part holds, and whose rank, R_g or Ravan's H r_h, FS's load into a fresh rank-r model would
        refuse)."""
        path = resume.server_path(self.cfg.federate.save_to)
        plan = self.method.plan
        states = {name: parts[name].state_dict() for name in resume.PARTS}
        model = {k: v for k, v in states["global_model"].pop("model").items() if not _LORA_KEY.search(k)}
        head = {"version": resume.VERSION, "method": self.method.name, "round": rnd, "settings": self.settings(),
                "plan": (list(plan.client_ranks), list(plan.reference_ranks), plan.R_g), "rng": resume.rng_state(),
                "client_files": self.client_files(path)}
        resume.save({"cur_round": rnd, "model": model, "fedpa_resume": {**head, **states}}, path)
        logger.info(f"[fedpa] resume point for round {rnd} written to {path}")
        return path

    def client_files(self, path: str) -> dict[int, tuple[int, str]]:
        """``client -> (round, file_id)`` of each client's newest file beside ``path``: the files a resume from this
        point restores, which it records so that another run's files (same settings or not) are refused. A file is
        read (its ``file_id`` only, :func:`fs_fedpa.resume.peek`) once, when it is new."""
        limit = resume.memory_bound()
        for client, (rnd, file) in resume.newest_files(path).items():
            if self.seen.get(client, (None,))[0] != rnd:
                token = resume.peek(file, "file_id", limit)
                if isinstance(token, str):
                    self.seen[client] = (rnd, token)
        return dict(self.seen)

    def restore(self, path: str, parts: dict, *, global_factors, local: dict[str, Tensor], clients: int,
                rounds: int) -> dict:
        """The resume point ``path``, checked (:meth:`read`), loaded into ``parts`` (as for :meth:`write`) by their
        ``load_state_dict``; returns its ``fedpa_resume`` head (``round``, ``rng``: the process's RNG states)."""
        self.model_numel = sum(t.numel() for t in parts["global_model"].model.state_dict().values())
        checkpoint, saved = self.read(path, global_factors=global_factors, local=local, clients=clients,
                                      rounds=rounds)  # fmt: skip
        for name in resume.PARTS:  # every part checked by its owner before any is loaded: no half-loaded server
            parts[name].check_state(saved[name], path, saved["round"])
        self._check_clients(path, saved, global_factors, local, clients)
        saved["global_model"]["model"] = checkpoint["model"]
        for name in resume.PARTS:
            parts[name].load_state_dict(saved[name], path)
        return {key: saved[key] for key in resume.HEAD_FIELDS}

    def read(self, path: str, *, global_factors, local: dict[str, Tensor], clients: int, rounds: int):
        """The resume point ``path``, its envelope checked: its method, ranks and settings are this run's and it
        leaves a round to train (``rounds``: ``federate.total_round_num``). Returns FS's checkpoint and its
        ``fedpa_resume`` dict, whose parts their owners check."""
        if not os.path.lexists(path):
            raise ValueError(f"federate.restore_from {path!r}: no such file")
        checkpoint = resume.load(path, self.bound(global_factors, local))
        resume.check_checkpoint(checkpoint, path)
        saved = checkpoint.get("fedpa_resume")
        if saved is None:
            raise ValueError(
                f"federate.restore_from {path!r} is not a FedPA resume point; runs with federate.save_to X write "
                f"them as {resume.server_path('X')} at the start of every round"
            )
        resume.check_server_fields(saved, path)
        plan = self.method.plan
        now = (list(plan.client_ranks), list(plan.reference_ranks), plan.R_g)
        if saved["method"] != self.method.name or tuple(map(tuple, saved["plan"][:2])) != tuple(map(tuple, now[:2])):
            raise ValueError(
                f"federate.restore_from {path!r} was saved by method {saved['method']!r} with ranks "
                f"{saved['plan']}; this run is {self.method.name!r} with {now}"
            )
        if saved["round"] >= rounds:
            raise ValueError(
                f"federate.restore_from {path!r} resumes at round {saved['round']}, but federate.total_round_num is "
                f"{rounds}: nothing is left to train; raise total_round_num to continue the run"
            )
        now_settings, then = self.settings(), named_now(saved["settings"])
        missing = object()  # a key this run has and the point does not: compared against nothing would pass it
        if changed := sorted(k for k in then.keys() | now_settings.keys()
                             if then.get(k, missing) != now_settings.get(k, missing)):  # fmt: skip
            diffs = ", ".join(f"{k}: saved {then.get(k, 'nothing')!r}, now {now_settings.get(k, 'nothing')!r}"
                              for k in changed)  # fmt: skip
            raise ValueError(f"federate.restore_from {path!r} was saved with other settings ({diffs})")
        return checkpoint, saved

    def bound(self, global_factors, local: dict[str, Tensor]) -> int:
        """The most bytes this run's server resume point can be: its model (FS's state, the merges, the factors) and
        FS's result history (:func:`fs_fedpa.resume.file_bound`)."""
        numel = sum(d * k for d, k in self.method.shapes.values()) * 3 + sum(t.numel() for t in local.values())
        numel += sum(B.numel() + A.numel() for B, A in global_factors.values()) * 4
        numel += self.model_numel
        rounds, clients = self.cfg.federate.total_round_num, self.cfg.federate.client_num
        return resume.file_bound(numel, records=(rounds + 1) * (clients + 1))

    def _check_clients(self, path: str, saved: dict, global_factors, local, clients: int) -> None:
        """Before any training: each client the run aggregated (its round log's ``clients``) has a file from before
        the point's round, and each client's newest such file (the one it will restore) is of the run the point
        recorded for that client (its ``file_id``, from the recorded round on: not another run's), that client's, of
        this run, well formed and finite (:func:`check_client_file`)."""
        rnd, recorded = saved["round"], saved["client_files"]
        trained = saved["round_log"]["clients"]
        if missing := [c for c in trained if not any(r < rnd for r in resume.client_files(path, c))]:
            expected = resume.client_path(path, missing[0], rnd - 1)
            raise ValueError(
                f"federate.restore_from {path!r}: the files of clients {missing} are missing (e.g. {expected}); "
                "without them those clients would restart from scratch"
            )
        at = f"federate.restore_from {path!r}: field 'client_files"
        for client in range(1, clients + 1):
            older = {r: p for r, p in resume.client_files(path, client).items() if r < rnd}
            if older:
                r = max(older)
                content = resume.load(older[r], ClientResume(self.cfg, self.method).bound(local))
                initial = self.method.client_init(global_factors, client - 1)  # from the run's initial global
                check_client_file(content, older[r], r, cfg=self.cfg, method=self.method, client=client,
                                  initial=initial, local=local)  # fmt: skip
                if client not in recorded:
                    raise ValueError(f"{at}' records no file of client {client}, but {older[r]} is there: it is not "
                                     "a file of the run this point saved; remove it, or resume from its own point")
                want_round, want_id = recorded[client]
                # a later file of the same run is the client's own newer state: a straggler of the round before the
                # point (distributed) wrote it after the point, as the uninterrupted run's client had trained it
                if content.get("file_id") != want_id or r < want_round:
                    raise ValueError(
                        f"resume file {older[r]}: field 'file_id' is {content.get('file_id')!r:.40} (round {r}), "
                        f"but {at}[{client}]' records client {client}'s files as {want_id!r} from round "
                        f"{want_round}: it is another run's file (or was replaced); resume each run from its own files"
                    )


def check_client_file(saved: dict, path, rnd: int, *, cfg, method, client: int, initial, local, data=None) -> None:
    """A client file checked, naming it and the field: its envelope (whose it is, its round and RNG states:
    :func:`fs_fedpa.resume.check_client_file`) and the client's state in it, by its owner
    (:meth:`~fs_fedpa.plugin.client_state.ClientState.check_state`; ``initial``: the client's initial factors,
    ``local``: its local tensors' initial values)."""
    resume.check_client_file(saved, path, rnd, cfg=cfg, method=method, client=client, data=data)
    ClientState.check_state(saved, path, rnd, method=method, initial=initial, local=local)


_LORA_KEY = re.compile(r"\.lora_[AB]\.")  # PEFT's names of the LoRA factors in a state dict


def check_resume_file(path: str) -> None:
    """ValueError with the plugin's message if ``federate.restore_from`` is missing, a folder, truncated, or holds
    anything but tensors, numbers and strings."""
    if not os.path.lexists(path) or os.path.isdir(path):
        what = "a folder" if os.path.isdir(path) else "no such file"
        raise ValueError(f"federate.restore_from {path!r}: {what}; give a resume file (fedpa_resume_<save_to name>)")
    resume.check_checkpoint(resume.load(path), path)


def named_now(settings: dict) -> dict:
    """A resume point's ``settings`` under today's key names: one written before the section was nested names a key
    by its old flat name (``fedpa.dp_clip``, ``fedpa.dp_horizon (or ...)``), which is the key ``fedpa.dp.clip``."""
    renamed = {f"fedpa.{old}": f"fedpa.{new}" for old, new in flat_names(FedPAConfig).items()}
    out = {}
    for label, value in settings.items():
        key, space, rest = label.partition(" ")
        out[renamed.get(key, key) + space + rest] = value
    return out
