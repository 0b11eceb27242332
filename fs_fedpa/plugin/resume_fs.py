"""Resume points: what the server writes at the start of every round and the clients after every round they
train (``federate.save_to``), and how a run continues from them (``federate.restore_from``). The file formats and
their checks are in :mod:`fs_fedpa.resume`; :class:`ClientResume` is a collaborator of the client,
:class:`ServerResume` still a mixin of the server."""

from __future__ import annotations

import logging
import os
import re

from torch import Tensor

from fs_fedpa import lora, resume
from fs_fedpa.plugin.common import non_lora_trainables
from fs_fedpa.plugin.privacy import accounting_settings

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

    def write(self, kept, snapshot: dict, client: int, rnd: int) -> None:
        """Client ``client``'s state after round ``rnd`` (``snapshot``: what it keeps, with round, id and rank)."""
        if self.out is None:
            return
        owner = resume.client_owner(self.cfg, self.method, client)  # whose it is: checked by every restore
        resume.save(
            {**snapshot, **owner, "rounds_trained": kept.rounds_trained, "rng": resume.rng_state()},
            resume.client_path(self.out, client, rnd),
        )
        for _, path in sorted(resume.client_files(self.out, client).items())[:-2]:
            path.unlink(missing_ok=True)

    def restore(self, kept, client: int, rnd: int, initial, device) -> None:
        """Once, in a resumed run: client ``client``'s newest state from before round ``rnd`` into ``kept``, if it
        ever trained. ``initial()``: the client's initial factors, which the file's shapes are checked against."""
        if self.pending is None:
            return
        path, self.pending = self.pending, None
        older = {r: p for r, p in resume.client_files(path, client).items() if r < rnd}
        if not older:
            return  # never trained before the resume point: it starts as a new client would
        saved = resume.load(older[max(older)])
        resume.check_client_file(  # the server checked it too; this client checks what it actually reads
            saved,
            older[max(older)],
            max(older),
            cfg=self.cfg,
            method=self.method,
            client=client,
            initial=initial(),
            local=kept.local,
        )
        kept.load(saved, device)
        if self.cfg.federate.mode == "distributed":  # its own process: its own random stream
            resume.set_rng_state(saved["rng"])
        logger.info(f"[fedpa] client {client} resumed its state of round {saved['round']}")


class ServerResume:
    """The server's resume point and its restore (which checks every client's file before any training)."""

    def _result_settings(self) -> dict:
        """The keys that change a run's result (recorded in every client file) and those its privacy accounting
        depends on (:func:`fs_fedpa.plugin.privacy.accounting_settings`), compared when it resumes."""
        return {**resume.result_settings(self._cfg, self.method), **accounting_settings(self._cfg)}

    def write_resume_point(self) -> str:
        """Everything the server needs to continue at round ``self.state`` (see :mod:`fs_fedpa.resume`)."""
        path = resume.server_path(self._cfg.federate.save_to)
        plan = self.method.plan
        resume.save(
            {
                "cur_round": self.state,
                # FS's checkpoint keys, so its own restore can read this file; without the LoRA factors, which are in
                # "global" and whose rank (R_g, Ravan's H r_h) FS's load into a fresh rank-r model would refuse
                # client-level DP: the initial local tensors, not a client's (with_public_locals)
                "model": self.with_public_locals(
                    {k: v for k, v in self.model.state_dict().items() if not _LORA_KEY.search(k)}
                ),
                "fedpa_resume": {
                    "method": self.method.name,
                    "round": self.state,
                    "plan": (list(plan.client_ranks), list(plan.reference_ranks), plan.R_g),
                    "settings": self._result_settings(),
                    "global": lora.copy_factors(self.global_factors, "cpu"),
                    "generator": self.generator.get_state(),
                    "totals": dict(self.rounds.totals),
                    "down_bytes": dict(self._down_bytes),
                    "merges": {
                        "merged": {n: t.cpu() for n, t in self.merged.items()},
                        "last": _moved(self._last_merge, "cpu") if self._last_merge is not None else {},
                        "count": self._merge_count,
                        "kept": dict(self._merged_kept),  # evaluation messages are sent again after a resume
                    },
                    "records": resume.plain(self.rounds.records),
                    "history_results": resume.plain(self.history_results),
                    "best_results": resume.plain(self.best_results),
                    "rng": resume.rng_state(),
                    "privacy": self.privacy.state() if self.privacy is not None else {},
                },
            },
            path,
        )
        logger.info(f"[fedpa] resume point for round {self.state} written to {path}")
        return path

    def restore(self, path: str) -> int:
        """Continue the run saved in the resume point ``path``; returns the round it continues at."""
        if not os.path.isfile(path):
            raise ValueError(f"federate.restore_from {path!r}: no such file")
        checkpoint = resume.load(path)
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
        if saved["round"] >= self.total_round_num:
            raise ValueError(
                f"federate.restore_from {path!r} resumes at round {saved['round']}, but federate.total_round_num is "
                f"{self.total_round_num}: nothing is left to train; raise total_round_num to continue the run"
            )
        now_settings, then = self._result_settings(), saved.get("settings", {})
        if changed := sorted(k for k in then if then[k] != now_settings.get(k)):
            diffs = ", ".join(f"{k}: saved {then[k]!r}, now {now_settings.get(k)!r}" for k in changed)
            raise ValueError(f"federate.restore_from {path!r} was saved with other settings ({diffs})")
        trained = sorted({c for record in saved["records"] for c in record.get("clients", [])})
        if missing := [c for c in trained if not any(r < saved["round"] for r in resume.client_files(path, c))]:
            expected = resume.client_path(path, missing[0], saved["round"] - 1)
            raise ValueError(
                f"federate.restore_from {path!r}: the files of clients {missing} are missing (e.g. {expected}); "
                "without them those clients would restart from scratch"
            )
        resume.check_global(saved["global"], path, self.global_factors, max(plan.r_g, plan.R_g))
        self._check_client_files(path, saved["round"])
        device = next(iter(self.global_factors.values()))[0].device
        self.install_global({n: (B.to(device), A.to(device)) for n, (B, A) in saved["global"].items()}, {})
        self.model.load_state_dict(checkpoint["model"], strict=False)  # shared tensors, e.g. a shared head
        self.keep_shared()
        self.generator.set_state(saved["generator"])
        self._down_bytes = dict(saved["down_bytes"])
        merges = saved.get("merges", {})
        self.merged = {n: t.to(device) for n, t in merges.get("merged", {}).items()}
        if "pending" in merges:  # a resume point of an older fs_fedpa: every merge some client lacked, in order
            pending = merges["pending"]
            self._merge_count = merges.get("dropped", 0) + len(pending)
            self._last_merge = _moved(pending[-1], device) if pending else None
        else:
            self._merge_count = merges.get("count", 0)
            self._last_merge = _moved(merges["last"], device) if merges.get("last") else None
        self._merged_upto, self._merged_kept = dict(merges.get("kept", {})), dict(merges.get("kept", {}))
        if self.merged:
            lora.set_base_offsets(self.model, self.merged)
        self.rounds.restore(saved["records"], saved["totals"])
        self.aggregator.failed_in_a_row = self.rounds.failed_in_a_row()
        self.history_results, self.best_results = saved["history_results"], saved["best_results"]
        self._pending_rng = saved["rng"]
        if self.privacy is not None:
            self.privacy.restore(saved.get("privacy"))
        self.state = saved["round"]
        logger.info(f"[fedpa] resumed from {path} at round {self.state}")
        return self.state

    def _check_client_files(self, path: str, rnd: int) -> None:
        """Before any training: each client's newest file from before round ``rnd`` (the one it will restore) must
        be that client's, of this run, well formed and finite (:func:`fs_fedpa.resume.check_client_file`)."""
        local_names, _ = non_lora_trainables(self.model, self._cfg.personalization.local_param)
        params = dict(self.model.named_parameters())
        for client in range(1, self.client_num + 1):
            older = {r: p for r, p in resume.client_files(path, client).items() if r < rnd}
            if older:
                r = max(older)
                resume.check_client_file(
                    resume.load(older[r]),
                    older[r],
                    r,
                    cfg=self._cfg,
                    method=self.method,
                    client=client,
                    initial=self.method.client_init(self.global_factors, client - 1),  # the run's initial global
                    local={n: params[n] for n in local_names},
                )


_LORA_KEY = re.compile(r"\.lora_[AB]\.")  # PEFT's names of the LoRA factors in a state dict


def check_resume_file(path: str) -> None:
    """ValueError with the plugin's message if ``federate.restore_from`` is missing, a folder, truncated, or holds
    anything but tensors, numbers and strings."""
    if not os.path.isfile(path):
        what = "a folder" if os.path.isdir(path) else "no such file"
        raise ValueError(f"federate.restore_from {path!r}: {what}; give a resume file (fedpa_resume_<save_to name>)")
    resume.load(path)


def _moved(merge: dict, device) -> dict:
    """A logged merge (per module its dense increment or its factors) on ``device``."""
    return {n: v.to(device) if isinstance(v, Tensor) else (v[0].to(device), v[1].to(device)) for n, v in merge.items()}
