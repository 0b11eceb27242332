"""What the Gaussian mechanisms (client level, sample level) share: the server's DP generator, the ledger
``<outdir>/fedpa_privacy.jsonl`` (one line a round) and its continuation on resume, the seed warning, and the
manifest's account of an export.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import secrets
from pathlib import Path

import torch
from torch import Tensor

from fs_fedpa.privacy.mechanism import dp_generator
from fs_fedpa.privacy.policy import EVERY_EXPORT, Mechanism, ServerPolicy
from fs_fedpa.record import PRIVACY_FILE

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


def noise_source(fedpa) -> str:
    """Where the DP noise and sampling come from, in words."""
    if fedpa.dp.seed >= 0:
        return "fedpa.dp.seed"
    return "the OS's cryptographic generator" if fedpa.dp.secure_rng else "MT19937 seeded from OS entropy"


def seed_warning(seed: int) -> str | None:
    """The warning a run with ``fedpa.dp.seed`` gets, in both modes (None without a seed)."""
    if seed < 0:
        return None
    return (
        f"[fedpa] fedpa.dp.seed(={seed}) is set: the DP noise and sampling are reproducible from it, and the "
        "(epsilon, delta) guarantee holds only while the seed stays secret; for a private release leave it at -1 (OS "
        "entropy)"
    )


def common_settings(cfg) -> dict:
    """The settings every Gaussian mechanism's accounting reads (:meth:`Mechanism.accounting_settings`)."""
    dp = cfg.fedpa.dp
    # seed: a seeded run continues its noise stream, an unseeded one draws fresh entropy; neither can become the
    # other across a resume
    keys = ("mode", "clip", "noise_multiplier", "epsilon", "delta", "sampling", "accountant", "seed")
    out = {f"fedpa.dp.{k}": getattr(dp, k) for k in keys}
    if dp.epsilon > 0:  # z calibrated over the horizon
        out["fedpa.dp.horizon (or federate.total_round_num)"] = int(dp.horizon or cfg.federate.total_round_num)
    out["federate.client_num"] = int(cfg.federate.client_num)
    return out


class GaussianMechanism(Mechanism):
    """Client or sample level: the run-level rules both share."""

    level = ""  # "client", "sample": the manifest's and the ledger's word for it

    @classmethod
    def check_run(cls, cfg, fedpa) -> None:
        try:
            import dp_accounting  # noqa: F401
        except ImportError as exc:
            raise ValueError(
                f"fedpa.dp.mode {fedpa.dp.mode!r} needs Google's dp-accounting: pip install 'fs_fedpa[dp]'"
            ) from exc
        if 0 < fedpa.dp.horizon < cfg.federate.total_round_num:
            raise ValueError(
                f"fedpa.dp.horizon(={fedpa.dp.horizon}) is below federate.total_round_num"
                f"(={cfg.federate.total_round_num}): the noise calibrated for it would spend more than "
                "fedpa.dp.epsilon"
            )
        if fedpa.dp.noise_multiplier > 0 and fedpa.dp.accountant == "pld":  # a calibrated z is checked as it is found
            from fs_fedpa.privacy.accountant import Sampled, check_pld_cost

            # one event's grid at the given z, which the sampling rate does not change: the smallest population
            check_pld_cost(Sampled(2, 1, fedpa.dp.noise_multiplier, fedpa.dp.sampling, "pld"), None)

    @classmethod
    def export_info(cls, fedpa, outdir: Path) -> dict:
        ledger = Path(outdir) / PRIVACY_FILE
        lines = ledger.read_text(encoding="utf-8").splitlines() if ledger.is_file() else []
        last = json.loads(lines[-1]) if lines else {}
        return {"dp_mode": fedpa.dp.mode, "epsilon": last.get("dp_epsilon"), "delta": last.get("dp_delta"),
                "adjacency": last.get("dp_adjacency"), "sampling": last.get("dp_sampling"),
                "accountant": last.get("dp_accountant")}  # fmt: skip


class GaussianServer(ServerPolicy):
    """The server's side of a Gaussian mechanism: the DP generator (and one for the method's sketches), the
    sampling, adjacency and accountant it states, the ledger and its continuation."""

    level = ""  # the ledger's dp_mode

    def __init__(self, cfg, method, *, clients: int, rounds: int, per_round: int, shared_names, global_factors):
        super().__init__(cfg, method, clients=clients, rounds=rounds, per_round=per_round, shared_names=shared_names,
                         global_factors=global_factors)  # fmt: skip
        from fs_fedpa.privacy.accountant import ADJACENCY, describe

        fedpa = method.cfg
        self.C, self.N, self.T = fedpa.dp.clip, clients, rounds
        self.generator = dp_generator(fedpa.dp.seed, "server", fedpa.dp.secure_rng)
        # the method's post-processing draws (a randomized SVD's sketch) take a torch generator: the DP one when it
        # is one (seeded runs stay reproducible), else one seeded from the cryptographic generator
        self.sketch_generator = (self.generator if isinstance(self.generator, torch.Generator)
                                 else torch.Generator().manual_seed(secrets.randbits(63)))  # fmt: skip
        self.sampling, self.accounting = fedpa.dp.sampling, fedpa.dp.accountant
        self.adjacency = ADJACENCY[self.sampling]
        self.accountant = describe(self.accounting)
        self.last: dict = {}
        self.ledger_digest = hashlib.sha256()  # of every byte this run's ledger holds: a resume point records it
        self.ledger_size = 0
        if (warning := seed_warning(fedpa.dp.seed)) is not None:
            logger.warning(warning)

    def epsilons(self) -> dict | None:
        last = self.last
        if not last:
            return None
        clients = last.get("dp_clients") or {}  # sample level: each client's own; client level: one for all
        return {"level": last["dp_mode"], "epsilon_max": last.get("dp_epsilon"), "delta": last.get("dp_delta"),
                "epsilon": {c: v.get("epsilon") if v else None for c, v in clients.items()},
                "adjacency": last.get("dp_adjacency"), "sampling": last.get("dp_sampling"),
                "accountant": last.get("dp_accountant")}  # fmt: skip

    def write(self, line: dict) -> dict:
        """Append ``line`` to the ledger; it is the last line from now on."""
        self.last = line
        data = (json.dumps(line) + "\n").encode("utf-8")
        with open(self.path, "ab") as f:
            f.write(data)
        self.ledger_digest.update(data)
        self.ledger_size += len(data)
        return line

    # ------------------------------------------------------------------------------------------ resume
    # what a resume point must carry (subclasses add); ``ledger_size``, ``ledger_sha256``: the ledger's bytes when the
    # point was written, which the ledger a resume continues must begin with (this run's, not another's)
    FIELDS: dict[str, type] = {"last": dict, "ledger": str, "ledger_size": int, "ledger_sha256": str}
    ROUND_COUNTS = ("rounds", "trained")  # counts of rounds (per client: a mapping), at most the point's round

    def state_dict(self) -> dict:
        """The accountant's counts, and the DP generator only with ``fedpa.dp.seed`` (reproducible runs). Without a
        seed the generator's state would let anyone holding the file regenerate every noise draw and subtract it; a
        resumed run draws from fresh OS entropy instead."""
        out = {"last": dict(self.last), "ledger": os.path.abspath(self.path), "ledger_size": self.ledger_size,
               "ledger_sha256": self.ledger_digest.hexdigest(), **self.counts()}
        if self.method.cfg.dp.seed >= 0:
            out["generator"] = self.generator.get_state()
        return out

    def counts(self) -> dict:
        """The accountant's counts, as the resume point carries them."""
        return {}

    def check_state(self, saved: dict, path: str, rnd: int) -> None:
        """ValueError naming the file and the field ``privacy.<key>`` unless the resume point ``path``'s ``privacy``
        field ``saved`` is one the accounting continues from: its counts (:meth:`counts_problem`), every field the
        accounting reads, the DP generator where seeded, and the ledger it names, which must begin with the bytes the
        point recorded (:meth:`continued_ledger`). A point the ledger cannot vouch for is not trusted."""
        super().check_state(saved, path, rnd)
        at = f"federate.restore_from {path!r}: field 'privacy"
        seeded = self.method.cfg.dp.seed >= 0  # reproducible: continue the stream; else fresh OS entropy
        for key, kind in (*self.FIELDS.items(), *((("generator", Tensor),) if seeded else ())):
            if not isinstance(saved.get(key), kind) or kind is int and isinstance(saved[key], bool):
                what = "missing" if key not in saved else f"a {type(saved[key]).__name__}, not a {kind.__name__}"
                raise ValueError(f"{at}.{key}' is {what}; the accounting of this run's past cannot continue from it")
        try:
            copy.copy(self).load_counts(saved)  # on a copy: nothing is loaded before every part is checked
        except (TypeError, ValueError):
            raise ValueError(f"{at}' holds counts that are not integers") from None
        if seeded:
            from fs_fedpa.rng_states import check_generator_state

            check_generator_state(saved["generator"], f"federate.restore_from {path!r}", "privacy.generator")
        self.continued_ledger(saved, path)

    def load_state_dict(self, saved: dict, path: str) -> None:
        """Continue the accounting of the resume point ``path`` (its ``privacy`` field ``saved``, checked by
        :meth:`check_state`). The ledger of the run it continues is the source of truth: a round released after the
        resume point was written (a crash between the release, which leaves with FS's evaluation broadcast, and the
        next round's resume point) is in the ledger but not in the point, and the resumed run releases that round
        again with fresh noise. So the counts are the larger of the two, and this run's ledger begins with the
        continued run's lines: one file states the whole run's epsilon."""
        self.load_counts(saved)
        self.last = dict(saved["last"])
        if self.method.cfg.dp.seed >= 0:
            self.generator.set_state(saved["generator"])
        continued = self.continued_ledger(saved, path)
        if continued is None:
            logger.warning(
                f"[fedpa] the DP ledger of the run this resumes ({saved['ledger']}) is not there: epsilon counts the "
                "releases up to the resume point only, not a round released after it before the run stopped"
            )
            return
        data, lines = continued
        if os.path.abspath(saved["ledger"]) != os.path.abspath(self.path):
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "wb") as f:
                f.write(data)
        self.ledger_digest, self.ledger_size = hashlib.sha256(data), len(data)
        if lines:
            self.continue_from(lines[-1])

    def continued_ledger(self, saved: dict, path: str) -> tuple[bytes, list[dict]] | None:
        """The bytes and lines of the ledger the resume point ``path`` names (``saved``: its ``privacy`` field), None
        if it is gone; ValueError naming it unless it begins with the bytes the point recorded (another run's ledger,
        or a changed one)."""
        previous = saved["ledger"]
        if not os.path.lexists(previous):
            return None
        data, lines = read_ledger(previous, self.ledger_line_ok, self.ledger_bound())
        size, digest = saved["ledger_size"], saved["ledger_sha256"]
        if len(data) < size or hashlib.sha256(data[:size]).hexdigest() != digest:
            raise ValueError(
                f"the DP ledger {previous!r} of the run this resumes does not begin with the {size} bytes its resume "
                f"point {path!r} recorded (field 'privacy.ledger_sha256'): it is another run's ledger, or was "
                "changed; the accounting of this run's past cannot continue from it"
            )
        return data, lines

    def ledger_bound(self) -> int:
        """The most bytes the ledger of a run of this one's rounds and clients can hold (one line a round, an entry
        per client in it, each far below these bytes)."""
        return 16 * 2**20 + (self.T + 1) * (4096 + 1024 * self.N)

    def counts_problem(self, saved: dict, rnd: int) -> str | None:
        """Each count of rounds (:data:`ROUND_COUNTS`) a non-negative int of at most ``rnd`` (a round releases once),
        per client where it is a mapping of client ids 1..N; every other count a non-negative int."""
        for key in (k for k in self.FIELDS if k not in GaussianServer.FIELDS):
            if key not in saved:
                continue  # named by check_state's own check of the fields
            value = saved[key]
            per_client = value.items() if isinstance(value, dict) else [(None, value)]
            for client, count in per_client:
                where = key if client is None else f"{key}[{client!r}]"
                top = rnd if key in self.ROUND_COUNTS else None
                if client is not None and not (_whole(client) and 1 <= int(client) <= self.N):
                    return f"{key}' names {client!r}, not a client id from 1 to {self.N}"
                whole = isinstance(count, int) and not isinstance(count, bool)
                if not whole or count < 0 or (top is not None and count > top):
                    bound = f"from 0 to the point's round {top}" if top is not None else ">= 0"
                    return f"{where}' is {count!r:.60}; it must be an int {bound}"
        return None

    def load_counts(self, saved: dict) -> None:
        """The counts of :meth:`counts` from the resume point's ``saved`` (TypeError/ValueError if not integers)."""

    def continue_from(self, last: dict) -> None:
        """The counts raised to those of the continued run's last ledger line ``last``, where it counts more."""

    def ledger_line_ok(self, entry: dict) -> bool:
        """Whether ``entry`` is a ledger line of this mechanism."""
        return isinstance(entry.get("round"), int) and entry.get("dp_mode") == self.level


def _whole(x) -> bool:
    """An int (not a bool), or a string of one (a JSON key)."""
    if isinstance(x, str):
        return x.isdigit()
    return isinstance(x, int) and not isinstance(x, bool)


def read_ledger(path: str, line_ok, limit: int) -> tuple[bytes, list[dict]]:
    """The bytes and lines of the DP ledger ``path``, each line passing ``line_ok``, read only if it is a regular
    file of at most ``limit`` bytes (:func:`fs_fedpa.files.read_regular`: a FIFO or a device is refused, never
    waited on or read); ValueError naming the file (and the line) for anything that is not one."""
    from fs_fedpa.files import read_regular

    data = read_regular(path, limit, f"the DP ledger {path!r} of the run this resumes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        what = type(err).__name__
        raise ValueError(f"the DP ledger {path!r} of the run this resumes cannot be read ({what})") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if not isinstance(entry, dict) or not line_ok(entry):
            raise ValueError(f"the DP ledger {path!r} of the run this resumes: line {number} is not a ledger line")
        lines.append(entry)
    return data, lines


def split_exports(level: str) -> tuple[list[str], list[str]]:
    """(the exported paths the guarantee covers, those it does not) at ``level`` "client" or "sample". Client level:
    the global adapter only; the clients' heads and own factors are trained on their data without DP. Sample level
    (DP-SGD): everything, the clients' heads included (clipped and noised, or with ``fedpa.dp.local_tensors frozen``
    held at their initial value, which no record touches)."""
    shared, own = EVERY_EXPORT
    if level == "client":
        return shared, [f"{p} (heads and own factors: trained without DP)" for p in own]
    return [*shared, *own], []
