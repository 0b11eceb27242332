"""The server's side of differential privacy (``fedpa.dp_mode``, docs/privacy.md): in client mode it samples K of N
clients, releases the noisy mean of their clipped contributions and accounts one event a round; in sample mode it
accounts each client's DP-SGD steps. Both write the ledger ``<outdir>/fedpa_privacy.jsonl``, one line a round. The
client's side and the settings both sides share are in :mod:`fs_fedpa.plugin.privacy`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets

import torch
from torch import Tensor

from fs_fedpa.core.dp import dp_generator, release_changes, release_products, release_shared, sample_poisson
from fs_fedpa.core.dp import shared_changes
from fs_fedpa.core.dp import sample_without_replacement as _sample
from fs_fedpa.core.ranks import truncate_factors
from fs_fedpa.plugin.privacy import SPENT_STATS, check_method, noise_source, routines, sample_plan, seed_warning
from fs_fedpa.record import PRIVACY_FILE, PRIVATE_FAULTS_FILE

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


class ServerPrivacy:
    """The server's side: client mode samples K of N, releases the noisy mean and accounts one event a round;
    sample mode accounts each client's DP-SGD steps. ``server.privacy`` is None when DP is off. It takes FS's
    ``cfg``, the server's federated ``method``, N ``clients``, T ``rounds``, K clients ``per_round``, the federated
    non-LoRA tensors' ``shared_names`` and the initial ``global_factors`` (for their shapes)."""

    def __init__(self, cfg, method, *, clients: int, rounds: int, per_round: int, shared_names, global_factors):
        from fs_fedpa.core.dp_accountant import ADJACENCY, describe

        self.cfg, self.method = cfg, method
        fedpa = method.cfg
        self.mode, self.C = fedpa.dp_mode, fedpa.dp_clip
        self.N, self.T = clients, rounds
        self.generator = dp_generator(fedpa.dp_seed, "server", fedpa.dp_secure_rng)
        # the method's post-processing draws (a randomized SVD's sketch) take a torch generator: the DP one when it
        # is one (seeded runs stay reproducible), else one seeded from the cryptographic generator
        self.sketch_generator = (self.generator if isinstance(self.generator, torch.Generator)
                                 else torch.Generator().manual_seed(secrets.randbits(63)))  # fmt: skip
        self.path = os.path.join(cfg.outdir, PRIVACY_FILE)
        self.sampling, self.accounting = fedpa.dp_sampling, fedpa.dp_accountant
        self.adjacency = ADJACENCY[self.sampling]
        self.accountant = describe(self.accounting)
        self.rounds = 0  # client mode: rounds released
        self.trained: dict[int, int] = {}  # sample mode: rounds each client was asked to train
        self.sizes: dict[int, int] = {}  # sample mode: n_i as the clients report it (public under replace-one)
        self.spent: dict[int, dict] = {}  # sample mode: each client's own account, as it last reported it
        self.last: dict = {}
        self.shared_names: list[str] = []
        if (warning := seed_warning(fedpa.dp_seed)) is not None:
            logger.warning(warning)
        if self.mode == "client":
            check_method(method, fedpa)
            # federated non-LoRA tensors (e.g. a shared head): each client's change of them is clipped with its
            # LoRA update as one contribution, and their mean is released with the same noise (release)
            self.shared_names = sorted(shared_names)
            plan = method.plan
            if method.dp_space == "change" and (
                set(plan.reference_ranks) != {plan.r_g} or set(plan.client_ranks) != {plan.r_g}
            ):
                raise ValueError(
                    f"fedpa.dp_mode client with federate.method {method.name}: a client's change is taken from "
                    f"the global factors it received, so every r_i and R_i must be {plan.r_g}"
                )
            self.K = per_round
            self.delta = fedpa.dp_delta_for(self.N)
            from fs_fedpa.core.dp_accountant import Sampled, calibrate

            horizon = fedpa.dp_horizon or self.T
            self.z = fedpa.dp_noise_multiplier or calibrate(self.N, self.K, horizon, fedpa.dp_epsilon, self.delta,
                                                            self.sampling, self.accounting)  # fmt: skip
            self.kind = Sampled(self.N, self.K, self.z, self.sampling, self.accounting)
            shapes = [(B.shape[0], A.shape[1]) for B, A in method.expand(global_factors).values()]
            if (
                method.dp_space == "product"
                and fedpa.svd != "randomized"
                and max(d * k for d, k in shapes) > 4e6
            ):
                logger.warning(
                    f"[fedpa] client-level DP forms each module's noisy (d, k) mean and factors it; at d x k up to "
                    f"{max(shapes, key=lambda s: s[0] * s[1])} an exact SVD takes minutes a module on a CPU "
                    "(docs/privacy.md): fedpa.svd randomized sketches it in about a second"
                )
            logger.info(
                f"[fedpa] client-level DP: K={self.K} of N={self.N} clients a round ("
                + ("without replacement" if self.sampling == "wor" else "Poisson: each at rate K/N, K expected")
                + f", from {noise_source(fedpa)}; {self.adjacency} adjacency, {self.accounting} accountant), clip "
                f"C={self.C:g}, "
                f"noise z={self.z:.4g} (std zC/K={self.z * self.C / self.K:.4g}), delta={self.delta:.3g}; "
                + (f"clipped and noised with the LoRA update: {', '.join(self.shared_names)}; " if self.shared_names
                   else "")  # fmt: skip
                + f"epsilon after {self.T} rounds: {self.kind.epsilon(self.T, self.delta):.4g}"
            )

    # ------------------------------------------------------------------------------------------ client mode
    @property
    def samples_clients(self) -> bool:
        return self.mode == "client"

    def fault(self, rnd: int, client, reason: str) -> None:
        """Client mode: a dropped upload. Whether a client's upload fails the checks, and why, can depend on its data
        (a NaN from its training), so it goes neither to the log nor to the diagnostics but to a server-private file
        beside the ledger, which docs/privacy.md lists as outside epsilon."""
        path = os.path.join(os.path.dirname(self.path), PRIVATE_FAULTS_FILE)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"round": rnd, "client": str(client), "reason": reason}) + "\n")

    @property
    def poisson_clients(self) -> bool:
        """Client mode with Poisson sampling: a round's receivers are as many as were drawn, possibly none."""
        return self.mode == "client" and self.sampling == "poisson"

    def receivers(self) -> list[int]:
        """Client ids of 1..N from the DP generator: K without replacement, or each at rate K/N (Poisson)."""
        if self.sampling == "poisson":
            return [i + 1 for i in sample_poisson(self.N, self.K / self.N, self.generator)]
        return [i + 1 for i in _sample(self.N, self.K, self.generator)]

    def release(self, uploads: list, clients: list[int], global_factors: dict, rnd: int,
                shared: list[dict[str, Tensor]] | None = None, shared_start: dict[str, Tensor] | None = None,
                ) -> tuple[dict, dict[str, Tensor], dict, dict[str, Tensor]]:  # fmt: skip
        """New global factors, spectra, the release of round ``rnd`` and the new federated non-LoRA tensors, from the
        accepted ``uploads`` (applied factors of ``clients``, complete), their ``shared`` tensors and the
        ``global_factors`` and ``shared_start`` the round started from: a missing or dropped client contributes zero,
        and the mean divides by K. A client's LoRA update and its shared tensors' change are clipped together."""
        method = self.method
        start_shared, changes, extra = {}, [], None
        if self.shared_names:
            start_shared = {n: shared_start[n] for n in self.shared_names}
            changes, extra = shared_changes([{n: s[n] for n in self.shared_names} for s in shared], start_shared)
        shapes = {n: (B.shape[0], A.shape[1]) for n, (B, A) in method.expand(global_factors).items()}
        if method.dp_space == "product":
            release, scales = release_products([method.expand(u) for u in uploads], shapes, self.K, self.C, self.z,
                                               self.generator, extra)  # fmt: skip
        else:
            parts = method.upload_parts(rnd)
            r = method.plan.r_g
            start = {n: truncate_factors(B, A, r) for n, (B, A) in global_factors.items()}
            release, scales = release_changes(uploads, [start] * max(len(uploads), 1), parts, self.K, self.C,
                                              self.z, self.generator, extra)  # fmt: skip
        new_shared = release_shared(changes, scales, self.K, self.C, self.z, self.generator, start_shared)
        new_global, spectra = method.dp_global(release, global_factors, self.sketch_generator)
        self.rounds += 1
        return new_global, spectra, release, new_shared

    # ------------------------------------------------------------------------------------------ sample mode
    def check_spent(self, rnd: int, stats: dict[int, dict]) -> dict[int, str]:
        """Sample mode: each uploading client's own account (:data:`~fs_fedpa.plugin.privacy.SPENT_STATS`) against
        what this server's config plans for its reported size: the same n_i, b, z, C and delta, a whole number of
        the plan's rounds of steps, no more than the rounds it was asked to train (this one included; fewer when it
        missed one), and the epsilon of those steps. Returns ``client -> reason`` for those whose account is missing
        or disagrees (their uploads are not aggregated; the reason also goes to the private faults file); every
        account is kept for the ledger, which states what each client spent."""
        refused = {}
        for c, st in stats.items():
            mine = {k: st.get(k) for k in SPENT_STATS}
            if any(v is None for v in mine.values()):
                refused[c] = "its upload carries no account of its DP-SGD steps (dp_n, dp_steps, dp_epsilon, ...)"
                continue
            self.spent[c] = mine
            size = st.get("num_train_data")
            if c in self.sizes and int(mine["dp_n"]) != self.sizes[c]:
                # the steps it took before were accounted at the earlier n_i (an earlier round's, or the resume
                # point's): a client whose data changed is not the one whose epsilon the ledger states
                refused[c] = (f"its training set has {int(mine['dp_n'])} records, but its DP-SGD steps so far were "
                              f"accounted at n_i={self.sizes[c]} (an earlier round, or the resume point)")  # fmt: skip
                self.fault(rnd, c, refused[c])
                continue
            plan = sample_plan(self.cfg, max(int(mine["dp_n"]), 1), routines(self.method))
            spr, most = plan.steps_per_round, (self.trained.get(c, 0) + 1) * plan.steps_per_round
            steps = int(mine["dp_steps"])
            if not (0 <= steps <= most and (steps % spr == 0 if spr else steps == 0)):
                steps = most  # not a count this plan can give: compared against the most it allows
            expected = {"dp_n": size, "dp_b": plan.b if spr else 0, "dp_steps": steps, "dp_z": plan.z,
                        "dp_clip": float(self.C), "dp_delta": plan.delta if spr else 0.0,
                        "dp_epsilon": plan.epsilon(steps)}  # fmt: skip
            off = [k for k in SPENT_STATS if not _close(mine[k], expected[k])]
            if off:
                shown = ", ".join(f"{k} {mine[k]:.6g} (the server's plan: {expected[k]:.6g})" for k in off)
                refused[c] = f"its DP-SGD account disagrees with the server's plan for n_i={size}: {shown}"
                self.fault(rnd, c, refused[c])
        return refused

    def _own_entry(self, own: dict) -> dict:
        """A client's ledger entry from its own account, when that is above the server's plan (its own config
        trained more, or it reported another size): the epsilon of its steps on its n_i and b at the server's z for
        that n_i, or the epsilon it reported if larger. Floats cross FS's wire as float32, so the reported figure
        alone could state a little less than was spent; the integers are exact."""
        n, b, steps = int(own["dp_n"]), int(own["dp_b"]), int(own["dp_steps"])
        plan = sample_plan(self.cfg, max(n, 1), routines(self.method))
        from fs_fedpa.core.dp_accountant import Sampled

        ours = Sampled(max(n, 1), max(b, 1), plan.z, self.sampling, self.accounting).epsilon(steps, plan.delta)
        return {"epsilon": max(ours, float(own["dp_epsilon"])), "delta": plan.delta, "noise_multiplier": plan.z,
                "steps": steps, "n": n, "b": b, "source": "client"}  # fmt: skip

    # ------------------------------------------------------------------------------------------ both
    def account(self, rnd: int, receivers: list[int], stats: dict[int, dict]) -> dict:
        """The ledger line of round ``rnd`` (written, and returned)."""
        if self.mode == "client":
            line = {
                "round": rnd,
                "dp_mode": "client",
                "dp_epsilon": self.kind.epsilon(self.rounds, self.delta),
                "dp_delta": self.delta,
                "dp_sampling": self.sampling,
                "dp_adjacency": self.adjacency,
                "dp_noise_multiplier": self.z,
                "dp_accountant_noise_multiplier": self.kind.accountant_z,
                "dp_sensitivity": self.kind.sensitivity * self.C / self.K,
                "dp_noise_std": self.z * self.C / self.K,
                "dp_clip": self.C,
                "dp_clients_per_round": self.K,
                "dp_population": self.N,
                "dp_events": self.rounds,
                "dp_accountant": self.accountant,
            }
        else:
            for c in receivers:
                self.trained[c] = self.trained.get(c, 0) + 1
            for c, st in stats.items():
                if c in self.sizes:  # its first size stays: the one its past steps were accounted at
                    continue
                size = int(self.spent[c]["dp_n"]) if c in self.spent else st.get("num_train_data")
                if isinstance(size, int) and size > 0:  # its own account's n_i, else what it reported
                    self.sizes[c] = size
            per_client = {}
            for c in sorted(self.trained):
                if c not in self.sizes:  # never reported its size: its epsilon is unknown here (its own log has it)
                    per_client[str(c)] = None
                    continue
                plan = sample_plan(self.cfg, self.sizes[c], routines(self.method))
                steps = self.trained[c] * plan.steps_per_round
                entry = {"epsilon": plan.epsilon(steps), "delta": plan.delta, "noise_multiplier": plan.z,
                         "steps": steps, "n": plan.n, "b": plan.b}  # fmt: skip
                own = self.spent.get(c)
                if own is not None and own["dp_epsilon"] > entry["epsilon"]:
                    entry = self._own_entry(own)
                per_client[str(c)] = entry
            known = [v for v in per_client.values() if v]
            line = {
                "round": rnd,
                "dp_mode": "sample",
                "dp_epsilon": max((v["epsilon"] for v in known), default=0.0),
                "dp_delta": max((v["delta"] for v in known), default=None),
                "dp_sampling": self.sampling,
                "dp_adjacency": self.adjacency,
                "dp_sensitivity": (2 if self.sampling == "wor" else 1) * self.C,
                "dp_clip": self.C,
                "dp_clients": per_client,
                "dp_accountant": self.accountant,
            }
        self.last = line
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        return line

    def summary(self) -> str:
        """The final (epsilon, delta), for the run's last log line."""
        if not self.last:
            return "[fedpa] differential privacy: no round was released, epsilon 0"
        line = self.last
        if self.mode == "client":
            return (
                f"[fedpa] differential privacy (client level): (epsilon, delta) = ({line['dp_epsilon']:.4g}, "
                f"{line['dp_delta']:.3g}) after {line['dp_events']} rounds, K={self.K} of N={self.N}, z={self.z:.4g}, "
                f"C={self.C:g} (ledger: {self.path})"
            )
        delta = line["dp_delta"]
        return (
            f"[fedpa] differential privacy (sample level, per client): largest epsilon {line['dp_epsilon']:.4g} at "
            f"delta {'?' if delta is None else format(delta, '.3g')} (per client in {self.path})"
        )

    def state(self) -> dict:
        """What a resume point carries: the accountant's counts, and the DP generator only with ``fedpa.dp_seed``
        (reproducible runs). Without a seed the generator's state would let anyone holding the file regenerate every
        noise draw and subtract it; a resumed run draws from fresh OS entropy instead."""
        out = {"rounds": self.rounds, "trained": dict(self.trained), "sizes": dict(self.sizes), "last": dict(self.last),
               "ledger": os.path.abspath(self.path)}  # fmt: skip
        if self.method.cfg.dp_seed >= 0:
            out["generator"] = self.generator.get_state()
        return out

    def restore(self, saved: dict, path: str) -> None:
        """Continue the accounting of the resume point ``path`` (its ``privacy`` field ``saved``). The ledger of the
        run it continues is the source of truth: a round released after the resume point was written (a crash
        between the release, which leaves with FS's evaluation broadcast, and the next round's resume point) is in
        the ledger but not in the point, and the resumed run releases that round again with fresh noise. So the
        counts are the larger of the two, and this run's ledger begins with the continued run's lines: one file
        states the whole run's epsilon. A field the accounting reads that is missing or malformed is refused, naming
        the file and the field: a point the ledger cannot vouch for is not trusted."""
        at = f"federate.restore_from {path!r}: field 'privacy"
        seeded = self.method.cfg.dp_seed >= 0  # reproducible: continue the stream; else fresh OS entropy
        needs = {"rounds": int, "trained": dict, "sizes": dict, "last": dict, "ledger": str}
        for key, kind in (*needs.items(), *((("generator", Tensor),) if seeded else ())):
            if not isinstance(saved.get(key), kind) or kind is int and isinstance(saved[key], bool):
                what = "missing" if key not in saved else f"a {type(saved[key]).__name__}, not a {kind.__name__}"
                raise ValueError(f"{at}.{key}' is {what}; the accounting of this run's past cannot continue from it")
        try:
            self.rounds = int(saved["rounds"])
            self.trained = {int(k): int(v) for k, v in saved["trained"].items()}
            self.sizes = {int(k): int(v) for k, v in saved["sizes"].items()}
        except (TypeError, ValueError):
            raise ValueError(f"{at}' holds counts that are not integers") from None
        self.last = dict(saved["last"])
        if seeded:
            self.generator.set_state(saved["generator"])
        self._continue_ledger(saved["ledger"])

    def _continue_ledger(self, previous: str) -> None:
        if not os.path.exists(previous):
            logger.warning(
                f"[fedpa] the DP ledger of the run this resumes ({previous}) is not there: epsilon counts the releases "
                "up to the resume point only, not a round released after it before the run stopped"
            )
            return
        lines = read_ledger(previous)
        if os.path.abspath(previous) != os.path.abspath(self.path):
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
        if not lines:
            return
        last = lines[-1]
        if self.mode == "client":
            spent = int(last.get("dp_events", 0))
            if spent > self.rounds:
                logger.warning(
                    f"[fedpa] the ledger of the resumed run counts {spent} released rounds and its resume point "
                    f"{self.rounds}: a round was released after the resume point was written; epsilon counts it"
                )
                self.rounds, self.last = spent, last
            return
        for c, entry in (last.get("dp_clients") or {}).items():
            if entry:
                spr = sample_plan(self.cfg, int(entry["n"]), routines(self.method)).steps_per_round
                if not spr:  # below fedpa.dp_min_records: no step, nothing spent
                    continue
                rounds = -(-int(entry["steps"]) // spr)
                if rounds > self.trained.get(int(c), 0):
                    self.trained[int(c)], self.sizes[int(c)], self.last = rounds, int(entry["n"]), last


def _close(a: float, b: float) -> bool:
    """Equal up to FS's wire, which carries floats as float32 (a relative 6e-8); counts are ints and exact."""
    return abs(float(a) - float(b)) <= 1e-6 * max(abs(float(a)), abs(float(b)), 1e-12)


def read_ledger(path: str) -> list[dict]:
    """The lines of the DP ledger ``path``; ValueError naming the file (and the line) for anything that is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
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
        if not isinstance(entry, dict) or not _is_ledger_line(entry):
            raise ValueError(f"the DP ledger {path!r} of the run this resumes: line {number} is not a ledger line")
        lines.append(entry)
    return lines


def _is_ledger_line(entry: dict) -> bool:
    if not isinstance(entry.get("round"), int) or entry.get("dp_mode") not in ("client", "sample"):
        return False
    if entry["dp_mode"] == "client":
        return isinstance(entry.get("dp_events"), int)
    clients = entry.get("dp_clients")
    return isinstance(clients, dict) and all(
        v is None or isinstance(v, dict) and isinstance(v.get("n"), int) and isinstance(v.get("steps"), int)
        for v in clients.values()
    )
