"""A run in one file: ``<outdir>/summary.json``, rewritten after every evaluation and at the end, with the same keys
for every method, and the per-round scalars a tracker (:mod:`fs_fedpa.tracking`) is fed. No FederatedScope here,
and no torch on import (the comparison reads summaries without it).

:class:`RunReport` (a collaborator of the server) owns what the summary needs beyond the server's other parts: the
evaluations so far (``curve``: each evaluation's weighted means under both protocols, the clients' evaluation
seconds, and the wall minutes and bytes at that point), the peak memory and the wall seconds of earlier processes of
a resumed run. A resume point carries it (:meth:`RunReport.state_dict`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from fs_fedpa.record import compact, finite
from fs_fedpa.values import finite_number

SUMMARY_FILE = "summary.json"
FORMAT = "fs_fedpa.summary/1"
OWN = "local."  # the metrics of each client's own factors (fedpa.eval.local): ``local.<split>_<metric>``
# the keys of summary.json whose values are times or memory: they differ between two runs of the same computation
TIMING_KEYS = ("wall_minutes", "peak_memory")
# the record's systems scalars (fs_fedpa.record.compact's), which a tracker shows under systems/
SYSTEMS_SCALARS = ("train_seconds_mean", "examples_per_s_mean", "tokens_per_s_mean", "peak_memory_max",
                   "aggregate_seconds", "server_peak_memory", "wall_seconds")  # fmt: skip


def protocols(metrics: dict) -> tuple[dict, dict]:
    """``metrics`` split into the paper protocol's (``global``) and each client's own factors' (``own``, the
    ``local.`` prefix taken off); only finite numbers."""
    numbers = {k: float(v) for k, v in metrics.items() if finite_number(v)}
    own = {k[len(OWN) :]: v for k, v in numbers.items() if k.startswith(OWN)}
    return {k: v for k, v in numbers.items() if not k.startswith(OWN)}, own


def read_summary(folder: str | Path) -> dict | None:
    """``<folder>/summary.json`` (None where there is none); ValueError naming the file for one that is not."""
    path = Path(folder) / SUMMARY_FILE
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not JSON ({err})") from None
    if not isinstance(summary, dict) or summary.get("format") != FORMAT:
        raise ValueError(f"{path} is not an fs_fedpa summary (its 'format' is not {FORMAT!r})")
    return summary


class RunReport:
    """The run's summary and tracker feed. ``head``: what the run is (``method``, ``rank_plan``, ``rounds``
    planned, ``metric``, FS's ``eval.best_res_update_round_wise_key``); ``tracker``: a
    :class:`~fs_fedpa.tracking.Tracker` (None: none)."""

    FIELDS = ("curve", "peak_memory", "seconds")  # its part of a resume point

    def __init__(self, outdir: str, head: dict, tracker=None, clock: Callable[[], float] = time.monotonic):
        self.path = os.path.join(outdir, SUMMARY_FILE)
        self.head, self.tracker, self.clock = head, tracker, clock
        self.curve: list[dict] = []
        self.peak_memory = {"bytes": 0, "kind": "rss"}
        self.before, self.started = 0.0, clock()  # wall seconds of the run's earlier processes; this one's start
        self._eval_seconds: dict[int, dict[str, float]] = {}

    def wall_seconds(self) -> float:
        """Since the run began, a resumed run's earlier processes included."""
        return self.before + self.clock() - self.started

    # ---------------------------------------------------------------------------------------------- what comes in
    def eval_seconds(self, rnd: int, client, seconds) -> None:
        """Client ``client``'s wall seconds of its evaluation of round ``rnd`` (beside its metrics)."""
        if finite_number(seconds):
            self._eval_seconds.setdefault(rnd, {})[str(client)] = float(seconds)

    def round_done(self, record: dict, spent: dict | None) -> None:
        """Round ``record`` (a :class:`~fs_fedpa.record.RoundRecord` as a dict) aggregated, ``spent`` the privacy
        spent so far (:meth:`~fs_fedpa.privacy.policy.ServerPolicy.epsilons`): the peak memory, and the tracker."""
        peaks = [v for v in (record.get("peak_memory") or {}).values() if finite_number(v)]
        peak = max([record.get("server_peak_memory") or 0, *peaks])
        if peak >= self.peak_memory["bytes"]:
            self.peak_memory = {"bytes": int(peak), "kind": record.get("memory_kind", "rss")}
        if self.tracker is None:
            return
        # compact's scalars, the systems ones (its means over clients included) under systems/
        scalars = {f"{'systems' if k in SYSTEMS_SCALARS else 'diagnostics'}/{k}": v
                   for k, v in compact(record).items() if finite_number(v)}  # fmt: skip
        scalars["systems/peak_memory_mib"] = peak / 2**20
        for client, seconds in (record.get("train_seconds") or {}).items():
            scalars[f"client/{client}/train_seconds"] = seconds
        if spent:
            scalars["privacy/epsilon_max"] = spent.get("epsilon_max")
            for client, epsilon in (spent.get("epsilon") or {}).items():
                scalars[f"client/{client}/epsilon"] = epsilon
        self.tracker.log(record["round"], scalars)

    def evaluated(self, rnd: int, weighted: dict, clients: dict, bytes_total: int) -> None:
        """The server's evaluation of round ``rnd``: the clients' ``weighted`` means (FS's ``Results_weighted_avg``)
        and each client's own metrics (``clients``: id -> metrics), at ``bytes_total`` bytes sent so far."""
        glob, own = protocols(weighted)
        entry = {"round": rnd, "minutes": self.wall_seconds() / 60, "bytes": int(bytes_total), "global": glob,
                 "own": own, "eval_seconds": self._eval_seconds.pop(rnd, {})}  # fmt: skip
        self.curve = [e for e in self.curve if e["round"] != rnd] + [entry]  # an evaluation asked again replaces it
        self.curve.sort(key=lambda e: e["round"])
        if self.tracker is None:
            return
        scalars = {f"global/{k}": v for k, v in glob.items()} | {f"own/{k}": v for k, v in own.items()}
        if seconds := entry["eval_seconds"]:
            scalars["systems/eval_seconds_mean"] = statistics.mean(seconds.values())
        for client, metrics in clients.items():
            scalars |= {f"client/{client}/{k}": v for k, v in metrics.items() if finite_number(v)}
        self.tracker.log(rnd, scalars)

    # ---------------------------------------------------------------------------------------------- the file
    def summary(self, *, rounds_done: int, bytes_up: int, bytes_down: int, privacy: dict | None,
                export: str | None, commit: str | None) -> dict:  # fmt: skip
        """The summary as plain data (the keys of docs/observability.md's table)."""
        final = self.curve[-1] if self.curve else None
        metric = self.head.get("metric", "")
        scored = [e for e in self.curve if finite_number(e["global"].get(metric))]
        best = None
        if scored:
            pick = min if "loss" in metric else max
            top = pick(scored, key=lambda e: e["global"][metric])  # the earliest of equal scores
            best = {"round": top["round"], "global": top["global"], "own": top["own"]}
        tracker = None
        if self.tracker is not None and self.tracker.kind != "none":
            tracker = {"kind": self.tracker.kind, "open": self.tracker.open_command()}
        return {
            "format": FORMAT,
            **{k: self.head[k] for k in ("method", "rank_plan", "metric")},
            "rounds": {"planned": self.head["rounds"], "done": rounds_done},
            "final": None if final is None else {"round": final["round"], "global": final["global"],
                                                 "own": final["own"]},  # fmt: skip
            "best": best,
            "bytes": {"up": bytes_up, "down": bytes_down, "total": bytes_up + bytes_down},
            "wall_minutes": self.wall_seconds() / 60,
            "peak_memory": dict(self.peak_memory),
            "privacy": privacy,
            "export": export,
            "commit": commit,
            "tracker": tracker,
            "curve": self.curve,
        }

    def write(self, summary: dict) -> str:
        """``summary`` to :attr:`path`, whole or not at all (a reader never sees half a file)."""
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(finite(summary), f, indent=1)
        os.replace(tmp, self.path)
        return self.path

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()

    # ---------------------------------------------------------------------------------------------- resume points
    def state_dict(self) -> dict:
        """For a resume point: the evaluations so far, the peak memory and the wall seconds so far."""
        return {"curve": json.loads(json.dumps(finite(self.curve))), "peak_memory": dict(self.peak_memory),
                "seconds": self.wall_seconds()}  # fmt: skip

    def check_state(self, state: dict, path: str, rnd: int) -> None:
        """ValueError naming ``path`` and the field ``run_report.<key>`` unless ``state`` is :meth:`state_dict`'s."""
        from fs_fedpa.state_checks import check_fields, check_mapping  # torch: not for the summary's readers

        at = f"federate.restore_from {path!r}"
        check_fields(state, at, "run_report", self.FIELDS)
        curve = state["curve"]
        if not isinstance(curve, list) or not all(
            isinstance(e, dict) and isinstance(e.get("round"), int) and isinstance(e.get("global"), dict)
            and isinstance(e.get("own"), dict) and finite_number(e.get("minutes")) and finite_number(e.get("bytes"))
            for e in curve):  # fmt: skip
            raise ValueError(f"{at}: field 'run_report.curve' is not a list of evaluations ({str(curve)[:100]})")
        check_mapping(state["peak_memory"], at, "run_report.peak_memory")
        seconds = state["seconds"]
        if not finite_number(state["peak_memory"].get("bytes")) or not finite_number(seconds) or seconds < 0:
            raise ValueError(f"{at}: field 'run_report.peak_memory' or 'run_report.seconds' is not a number >= 0")

    def load_state_dict(self, state: dict, path: str) -> None:
        self.curve = [dict(e) for e in state["curve"]]
        self.peak_memory = {"bytes": int(state["peak_memory"]["bytes"]),
                            "kind": str(state["peak_memory"].get("kind", "rss"))}  # fmt: skip
        self.before, self.started = float(state["seconds"]), self.clock()


def code_commit(module_file: str) -> str | None:
    """The git commit of the checkout holding ``module_file`` (the code a run ran), with ``+dirty`` where tracked
    files differ from it; None for an installed copy outside a git checkout."""
    root = Path(module_file).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if sha.returncode != 0:
            return None
        status = ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"]
        dirty = subprocess.run(status, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha.stdout.strip() + ("+dirty" if dirty else "")

