"""Sample-level DP (``fedpa.dp.mode sample``, docs/privacy.md): each client trains by DP-SGD over its own records
(:class:`SampleLevelClient`, on the plugin's DP-SGD hooks), accounts its own steps and reports that account with its
upload; the server checks each account against the plan its own config gives that client and states in its ledger
what each client spent (:class:`SampleLevelServer`).

Why one module over 450 lines: the client's account and the server's check of it must read the same plan and change
together.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

from fs_fedpa.privacy.label_prior import LabelPrior
from fs_fedpa.privacy.mechanism import dp_generator
from fs_fedpa.privacy.policy import ClientPolicy
from fs_fedpa.privacy.private import GaussianMechanism, GaussianServer, common_settings, split_exports
from fs_fedpa.privacy.sample_plan import SPENT_STATS, SamplePlan, account_problem, clip_groups, routines, sample_plan
from fs_fedpa.values import finite_number as _number
from fs_fedpa.record import CLIENT_PRIVACY_FILE, PRIVATE_FAULTS_FILE

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only

# what a client sends of its statistics: everything computed from its DP factors, but not the task-gradient ratios
# (raw data); with what it reports it spent (SampleLevelClient.spent; SampleLevelServer.admit)
# kept on the client: the raw task gradient's norms, and its timings and counts (fs_fedpa.systems.SYSTEMS_STATS), which
# depend on how many records the round drew
RAW_DATA_STATS = ("grad_ratio_", "sys_")
SAT_OUT = ("took no DP-SGD step (its account: 0 steps; fedpa.dp.min_records): its upload carries no training and is "
           "not aggregated")  # fmt: skip


def frozen_names(treatment: str, local_names: list[str]) -> frozenset[str]:
    """The tensors DP-SGD holds still: with ``fedpa.dp.local_tensors frozen`` the client's local tensors (a head),
    which keep the value they were built with, a value no record touches; DP-SGD clips and noises every tensor that
    moves, so what the client releases is post-processing of the mechanism alone."""
    return _local(treatment, "frozen", "freeze", local_names)


def grouped_names(treatment: str, local_names: list[str]) -> frozenset[str]:
    """The tensors DP-SGD clips as a group of their own (``fedpa.dp.local_tensors grouped``): the client's local
    tensors, clipped to ``fedpa.dp.local_clip`` and noised at z sqrt(2) times it, the rest at z sqrt(2) C."""
    return _local(treatment, "grouped", "group", local_names)


def _local(treatment: str, wanted: str, verb: str, local_names: list[str]) -> frozenset[str]:
    if treatment != wanted:
        return frozenset()
    if not local_names:
        raise ValueError(
            f"fedpa.dp.local_tensors {wanted!r} with no local tensor to {verb}: personalization.local_param names "
            "none of the model's trainable non-LoRA tensors"
        )
    return frozenset(local_names)


class SampleLevelClient(ClientPolicy):
    """DP-SGD on FS's ``trainer`` (``dp_sgd``: the plugin's hooks, which replace its step; ``num_train_data`` is the
    client's n_i), what of its statistics leaves, and its own account: in its log, in its upload (:meth:`spent`) and
    as a line a round of :data:`~fs_fedpa.record.CLIENT_PRIVACY_FILE` (:meth:`record`). ``fedpa.dp.local_tensors
    frozen`` holds its local tensors at their initial value."""

    @classmethod
    def task_gradient_diagnostics(cls, wanted: bool) -> bool:
        """None: the gradient it trains on is DP-SGD's noisy one, not the task's."""
        return False

    def __init__(self, cfg, method, trainer, local_names: list[str], dp_sgd=None):
        super().__init__(cfg, method, trainer, local_names, dp_sgd)
        fedpa = self.fedpa
        self.path = os.path.join(cfg.outdir, CLIENT_PRIVACY_FILE)
        if dp_sgd is None:
            raise ValueError("fedpa.dp.mode sample needs the plugin's DP-SGD hooks (fs_fedpa.plugin.dp_sgd.DPSGD)")

        def plan(n: int) -> SamplePlan:
            return sample_plan(cfg, n, routines(method))

        def make_generator(routine: int):  # a torch.Generator or a SecureGenerator (dp_generator)
            stream = f"client {self.client} round {self.rnd} routine {routine}"
            return dp_generator(fedpa.dp.seed, stream, fedpa.dp.secure_rng)

        # fedpa.dp.label_prior: the count is drawn at the first training routine (logit_bias)
        self.prior = LabelPrior(fedpa.dp.label_prior, cfg.model.seqcls.num_labels) if fedpa.dp.label_prior else None
        frozen = frozen_names(fedpa.dp.local_tensors, local_names)
        local = grouped_names(fedpa.dp.local_tensors, local_names)
        self.dp_sgd = dp_sgd(trainer, plan, make_generator, fedpa.dp.clip, chunk=fedpa.dp.chunk or None,
                             frozen=frozen, local=local, local_clip=fedpa.dp.local_clip)  # fmt: skip
        n = trainer.ctx.get("num_train_data")
        if isinstance(n, int) and n > 0:
            plan(n)  # now, not in the first batch: a delta above min(1e-5, 1/(10 n_i)) is refused at start

    def new_round(self, client: int, rnd: int) -> None:
        super().new_round(client, rnd)
        self.dp_sgd.new_round()

    @property
    def sits_out(self) -> bool:
        """``fedpa.dp.min_records``: this client has fewer records and takes no DP-SGD step."""
        if not self.fedpa.dp.min_records:
            return False
        n = self.trainer.ctx.get("num_train_data")
        return isinstance(n, int) and n < self.fedpa.dp.min_records

    def logit_bias(self, labels, training: bool):
        """b = log pi^ of the label prior (``fedpa.dp.label_prior``), released at the first training routine
        from its own DP stream (a seeded resumed run draws the same); None without it, before it, or for a client
        that sits out (it draws no count)."""
        if self.prior is None or self.sits_out:
            return None
        if self.prior.bias is None and training:
            stream = f"client {self.client} label prior"
            self.prior.release(labels(), dp_generator(self.fedpa.dp.seed, stream, self.fedpa.dp.secure_rng))
        return self.prior.bias

    def state_dict(self) -> dict:
        """b once released, so a resumed run adds the same without a second count."""
        return self.prior.state_dict() if self.prior is not None else {}

    def load_state_dict(self, saved: dict, at: str) -> None:
        if self.prior is not None and not self.sits_out:
            self.prior.load_state_dict(saved, at)

    def stats(self, stats: dict, rounds_trained: int = 0) -> dict:
        """Every statistic but the raw-gradient ones, with what it spent after ``rounds_trained`` rounds
        (:meth:`spent`), which the server checks and its ledger records."""
        return {**{k: v for k, v in stats.items() if not k.startswith(RAW_DATA_STATS)}, **self.spent(rounds_trained)}

    def spent(self, rounds_trained: int) -> dict:
        """This client's own account as upload stats (:data:`SPENT_STATS`): n_i, b, steps so far, z, C, delta and
        epsilon, from the plan its own config gave it; zeros for a client that sits out."""
        n = self.trainer.ctx.get("num_train_data")
        plan = self.dp_sgd.plan_in_use
        if self.sits_out or plan is None:
            return {"dp_n": int(n or 0), "dp_b": 0, "dp_steps": 0, "dp_z": 0.0, "dp_clip": float(self.fedpa.dp.clip),
                    "dp_delta": 0.0, "dp_epsilon": 0.0}  # fmt: skip
        steps = rounds_trained * plan.steps_per_round
        clip = float(self.fedpa.dp.clip)
        return {"dp_n": plan.n, "dp_b": plan.b, "dp_steps": steps, "dp_z": plan.z, "dp_clip": clip,
                "dp_delta": plan.delta, "dp_epsilon": plan.epsilon(steps)}  # fmt: skip

    def sample_size(self, sample_size: int) -> int:
        """0 for a client that sits out (its upload weighs nothing); under Poisson DP-SGD the expected count of the
        round's steps, not how many records the draws held (which adding or removing one would change)."""
        if self.sits_out:
            return 0
        plan = self.dp_sgd.plan_in_use
        if plan is not None and plan.sampling == "poisson":
            return plan.steps_per_round * plan.b
        return sample_size

    def log_round(self, rounds_trained: int) -> None:
        """The client's own epsilon after ``rounds_trained`` rounds, in its own log and as a line of its own
        :data:`~fs_fedpa.record.CLIENT_PRIVACY_FILE` (:meth:`record`)."""
        if self.sits_out:
            n = self.trainer.ctx.get("num_train_data")
            logger.info(
                f"[fedpa] client #{self.client}: {n} training records, fewer than fedpa.dp.min_records"
                f"(={self.fedpa.dp.min_records}): it takes no DP-SGD step, sends the factors it started "
                "from with sample size 0 (no weight), and spends epsilon 0"
            )
            self._write({**self._account(rounds_trained), "sits_out": True, "prior_sigma": 0.0, "clipped_sum": None,
                         "noise": None})  # fmt: skip
            return
        if self.dp_sgd.plan_in_use is None:
            return
        plan = self.dp_sgd.plan_in_use
        line = self.record(rounds_trained)
        self._write(line)
        logger.info(
            f"[fedpa] client #{self.client}: DP-SGD epsilon {line['epsilon']:.4g} at delta {plan.delta:.3g} after "
            f"{line['steps']} steps (n={plan.n}, b={plan.b}{' expected' if plan.sampling == 'poisson' else ''}, "
            f"z={plan.z:.4g}, C={self.fedpa.dp.clip:g}"
            + (f"; {plan.groups} clipping groups, the local tensors' at C_h={self.dp_sgd.C_local:g}, each noised at "
               f"z_g={plan.z_group:.4g}" if plan.groups > 1 else "")
            + (f"; with its label count, sigma={plan.prior_sigma:g}" if plan.prior_sigma else "")
            + f"; {plan.sampling} sampling, {plan.accounting})"
            + (f"; {line['nonfinite']} records of this round had a non-finite gradient and contributed "
               "zero" if line["nonfinite"] else "")
            + (f"; {line['empty']} steps drew no record (Poisson) and were noise alone" if line["empty"] else "")
            + signal_noise_text(self.dp_sgd.signal_noise())
        )

    def _write(self, line: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def _account(self, rounds_trained: int) -> dict:
        """The round, the client and :meth:`spent` under the file's names (n, b, steps, z, clip, delta, epsilon)."""
        own = {k.removeprefix("dp_"): v for k, v in self.spent(rounds_trained).items()}
        return {"round": self.rnd, "client": self.client, **own}

    def record(self, rounds_trained: int) -> dict:
        """This client's accounting after ``rounds_trained`` rounds (what its upload reports, :meth:`spent`) and the
        round's signal against noise (per step: the clipped sum's norm and the noise's; None without a step)."""
        plan = self.dp_sgd.plan_in_use
        norms = self.dp_sgd.signal_noise()
        # clipping groups: z is the accounted multiplier, each group noised at z sqrt(groups) times its clip
        groups = {"groups": plan.groups, "clip_local": self.dp_sgd.C_local} if plan.groups > 1 else {}
        return {**self._account(rounds_trained), **groups, "sampling": plan.sampling, "accountant": plan.accounting,
                "prior_sigma": plan.prior_sigma, "nonfinite": self.dp_sgd.round_nonfinite,
                "empty": self.dp_sgd.round_empty,
                "clipped_sum": None if norms is None else float(norms[0]),
                "noise": None if norms is None else float(norms[1])}  # fmt: skip


def signal_noise_text(norms: tuple[float, float] | None) -> str:
    """The round's signal against noise in the client's own log (it reads the client's records, so it is never
    sent); the report reads the same figures from :data:`~fs_fedpa.record.CLIENT_PRIVACY_FILE`, never from here."""
    if norms is None:
        return ""
    signal, noise = norms
    ratio = f"{noise / signal:.3g}" if signal > 0 else "inf"
    return (f"; this round, per step, clipped sum {signal:.4g} against noise {noise:.4g} (noise/signal {ratio}; "
            "from its records: this log only, never sent)")


class SampleLevelServer(GaussianServer):
    """Accounts each client's DP-SGD steps: the rounds it was asked to train, at the n_i it reported first, against
    the account it reports (:meth:`admit`); the ledger states per client what it spent, and the largest."""

    level = "sample"
    FIELDS = {"trained": dict, "sizes": dict, **GaussianServer.FIELDS}

    def __init__(self, cfg, method, *, clients: int, rounds: int, per_round: int, shared_names, global_factors):
        super().__init__(cfg, method, clients=clients, rounds=rounds, per_round=per_round, shared_names=shared_names,
                         global_factors=global_factors)  # fmt: skip
        self.trained: dict[int, int] = {}  # rounds each client was asked to train
        self.sizes: dict[int, int] = {}  # n_i as the clients report it (public under replace-one)
        self.spent: dict[int, dict] = {}  # each client's own account, as it last reported it (valid ones only)
        self.no_guarantee: dict[int, str] = {}  # why no epsilon holds for a client: it sent without DP, or an
        # account outside the bounds; once so, for the rest of the run (its ledger entry states none)

    def _plan(self, n: int) -> SamplePlan:
        return sample_plan(self.cfg, max(n, 1), routines(self.method))

    def admit(self, rnd: int, stats: dict[int, dict]) -> dict[int, str]:
        """Each uploading client's own account (:data:`SPENT_STATS`) against what this server's config plans for its
        reported size: the same n_i, b, z, C and delta, a whole number of the plan's rounds of steps, no more than
        the rounds it was asked to train (this one included; fewer when it missed one), and the epsilon of those
        steps. Returns ``client -> reason`` for those whose account is missing or disagrees (their uploads are not
        aggregated; the reason also goes to the private faults file). An account is checked against
        :meth:`account_problem`'s bounds before any plan is computed for it, and whatever the accountant still raises
        for one client refuses that client: no account ends the run. A valid account is kept for the ledger, which
        states what each client spent; a client with no account (it sent without DP) or one outside the bounds has
        no guarantee the ledger could state (:attr:`no_guarantee`)."""
        refused = {}

        def refuse(c, reason: str, guarantee: bool = True) -> None:
            refused[c] = reason
            self.fault(rnd, c, reason)
            if not guarantee:
                self.no_guarantee.setdefault(c, reason)

        for c, st in stats.items():
            mine = {k: st.get(k) for k in SPENT_STATS}
            if missing := [k for k in SPENT_STATS if mine[k] is None]:
                refuse(c, f"its upload carries no account of DP-SGD steps ({', '.join(missing)} missing or not "
                          "finite): it was sent without DP-SGD as far as the server can tell, so no guarantee holds "
                          "for its records (its ledger entry states none)", guarantee=False)  # fmt: skip
                continue
            if (problem := self.account_problem(mine)) is not None:
                refuse(c, f"its DP-SGD account is not one the plugin's DP-SGD gives: {problem}; no guarantee can "
                          "be stated for its records (its ledger entry states none)", guarantee=False)  # fmt: skip
                continue
            self.spent[c] = mine
            size = st.get("num_train_data")
            if not _number(size):  # checked before the plan is read for it: a missing size must not stop the run
                refuse(c, f"its upload reports no training set size (num_train_data {size!r}) beside its DP account")
                continue
            if c in self.sizes and int(mine["dp_n"]) != self.sizes[c]:
                # the steps it took before were accounted at the earlier n_i (an earlier round's, or the resume
                # point's): a client whose data changed is not the one whose epsilon the ledger states
                refuse(c, f"its training set has {int(mine['dp_n'])} records, but its DP-SGD steps so far were "
                          f"accounted at n_i={self.sizes[c]} (an earlier round, or the resume point)")  # fmt: skip
                continue
            try:
                expected = self._expected(c, mine, size)
            except Exception as err:  # one client's account, whatever the accountant raises for it
                refuse(c, f"its DP-SGD account cannot be accounted ({type(err).__name__}: {str(err)[:200]})",
                       guarantee=False)  # fmt: skip
                continue
            off = [k for k in SPENT_STATS if not _close(mine[k], expected[k])]
            if off:
                shown = ", ".join(f"{k} {mine[k]:.6g} (the server's plan: {expected[k]:.6g})" for k in off)
                refuse(c, f"its DP-SGD account disagrees with the server's plan for n_i={size}: {shown}")
        return refused

    def set_aside(self, stats: dict[int, dict]) -> dict[int, str]:
        """A client that took no DP-SGD step (``fedpa.dp.min_records``; its account says 0 steps) sends no training:
        whatever its factors, they are not aggregated (a method that weighs uploads by their norm, or a round of only
        such uploads, would take them)."""
        return {c: SAT_OUT for c, st in stats.items() if st.get("dp_steps") == 0}

    def _expected(self, c: int, mine: dict, size) -> dict:
        """The account the server's plan gives client ``c`` for the steps ``mine`` reports (the most it allows where
        that is not a count the plan can give), at its reported ``size``."""
        plan = self._plan(int(mine["dp_n"]))
        spr, most = plan.steps_per_round, (self.trained.get(c, 0) + 1) * plan.steps_per_round
        steps = int(mine["dp_steps"])
        if not (0 <= steps <= most and (steps % spr == 0 if spr else steps == 0)):
            steps = most  # not a count this plan can give: compared against the most it allows
        return {"dp_n": size, "dp_b": plan.b if spr else 0, "dp_steps": steps, "dp_z": plan.z,
                "dp_clip": float(self.C), "dp_delta": plan.delta if spr else 0.0,
                "dp_epsilon": plan.epsilon(steps)}  # fmt: skip

    def account_problem(self, mine: dict) -> str | None:
        """:func:`~fs_fedpa.privacy.sample_plan.account_problem` at this run's plan, delta, sampling and accountant."""
        return account_problem(mine, self._plan, self.method.cfg.dp.delta, self.sampling, self.accounting)

    def _own_entry(self, own: dict) -> dict:
        """A client's ledger entry from its own account, when that is above the server's plan (its own config
        trained more, or it reported another size): the epsilon of its steps on its n_i and b at the server's z for
        that n_i, or the epsilon it reported if larger. Floats cross FS's wire as float32, so the reported figure
        alone could state a little less than was spent; the integers are exact."""
        n, b, steps = int(own["dp_n"]), int(own["dp_b"]), int(own["dp_steps"])
        plan = self._plan(n)
        ours = replace(plan, n=max(n, 1), b=max(b, 1)).epsilon(steps)  # its n_i and b, the server's z and count
        return {"epsilon": max(ours, float(own["dp_epsilon"])), "delta": plan.delta, "noise_multiplier": plan.z,
                "steps": steps, "n": n, "b": b, "prior_sigma": plan.prior_sigma, "source": "client"}  # fmt: skip

    def account(self, rnd: int, receivers: list[int], stats: dict[int, dict]) -> dict:
        """Round ``rnd``'s ledger line: per client that was asked to train, the epsilon of the rounds it trained at
        the n_i of its first valid account (the plan's, or its own account where that states more); for a client
        with no guarantee (:attr:`no_guarantee`) epsilon null, ``guarantee`` "none" and the reason; None for one
        whose size is unknown. ``dp_epsilon``: the largest, null where a client has no guarantee (listed in
        ``dp_no_guarantee``)."""
        for c in receivers:
            self.trained[c] = self.trained.get(c, 0) + 1
        for c in stats:
            if c not in self.sizes and c in self.spent:  # its first size stays: the one its past steps were at
                size = int(self.spent[c]["dp_n"])
                if size > 0:
                    self.sizes[c] = size
        per_client = {}
        for c in sorted(self.trained):
            if c not in self.no_guarantee and c not in self.sizes:  # its epsilon is unknown here (its log has it)
                per_client[str(c)] = None
                continue
            if c not in self.no_guarantee:
                try:
                    per_client[str(c)] = self._entry(c)
                    continue
                except Exception as err:  # one client's account, whatever the accountant raises for it
                    reason = f"its DP-SGD account cannot be accounted ({type(err).__name__}: {str(err)[:200]})"
                    self.no_guarantee[c] = reason
                    self.fault(rnd, c, reason)
            per_client[str(c)] = {"epsilon": None, "delta": None, "guarantee": "none",
                                  "reason": self.no_guarantee[c], "n": self.sizes.get(c), "steps": None}  # fmt: skip
        known = [v for v in per_client.values() if v and v.get("guarantee") != "none"]
        none = [c for c, v in per_client.items() if v and v.get("guarantee") == "none"]
        dp = self.method.cfg.dp  # clipping groups: dp_z is the accounted z, each group noised at z sqrt(k) C_g
        k = clip_groups(dp.local_tensors)
        groups = {"dp_groups": k, "dp_clip_local": float(dp.local_clip or dp.clip)} if k > 1 else {}
        line = {
            "round": rnd,
            "dp_mode": "sample",
            # no finite epsilon where a client has none: null (standard JSON has no Infinity), named below
            "dp_epsilon": None if none else max((v["epsilon"] for v in known), default=0.0),
            "dp_delta": max((v["delta"] for v in known if v["delta"] is not None), default=None),
            "dp_sampling": self.sampling,
            "dp_adjacency": self.adjacency,
            "dp_sensitivity": (2 if self.sampling == "wor" else 1) * self.C,
            "dp_clip": self.C,
            **groups,
            "dp_clients": per_client,
            "dp_accountant": self.accountant,
        }  # fmt: skip
        if none:
            line["dp_no_guarantee"] = none
        return self.write(line)

    def _entry(self, c: int) -> dict:
        """Client ``c``'s ledger entry: the plan's epsilon for the rounds it trained, or its own account's where that
        states more (:meth:`_own_entry`)."""
        plan = self._plan(self.sizes[c])
        steps = self.trained[c] * plan.steps_per_round
        entry = {"epsilon": plan.epsilon(steps), "delta": plan.delta, "noise_multiplier": plan.z,
                 "steps": steps, "n": plan.n, "b": plan.b, "prior_sigma": plan.prior_sigma}  # fmt: skip
        own = self.spent.get(c)
        if own is not None and own["dp_epsilon"] > entry["epsilon"]:
            entry = self._own_entry(own)
        return entry

    def summary(self) -> str:
        if not self.last:
            return "[fedpa] differential privacy: no round was released, epsilon 0"
        delta = self.last["dp_delta"]
        at = f"at delta {'?' if delta is None else format(delta, '.3g')} (per client in {self.path})"
        if none := self.last.get("dp_no_guarantee"):
            guaranteed = [v["epsilon"] for v in self.last["dp_clients"].values() if v and v.get("guarantee") != "none"]
            others = f"{max(guaranteed):.4g} {at}" if guaranteed else "none"
            return (
                f"[fedpa] differential privacy (sample level, per client): no guarantee for client "
                f"{', '.join(none)} (sent without DP-SGD or with an account the server cannot check: epsilon unbounded; "
                f"reasons in {PRIVATE_FAULTS_FILE}); largest epsilon of the other clients {others}"
            )
        largest = self.last["dp_epsilon"]
        return f"[fedpa] differential privacy (sample level, per client): largest epsilon {largest:.4g} {at}"

    def counts(self) -> dict:
        return {"trained": dict(self.trained), "sizes": dict(self.sizes), "no_guarantee": dict(self.no_guarantee)}

    def load_counts(self, saved: dict) -> None:
        self.trained = {int(k): int(v) for k, v in saved["trained"].items()}
        self.sizes = {int(k): int(v) for k, v in saved["sizes"].items()}
        self.no_guarantee = {int(k): str(v) for k, v in dict(saved.get("no_guarantee") or {}).items()}

    def continue_from(self, last: dict) -> None:
        for c, entry in (last.get("dp_clients") or {}).items():
            if entry and entry.get("guarantee") == "none":  # once without a guarantee, for the rest of the run
                self.no_guarantee.setdefault(int(c), str(entry.get("reason")))
            elif entry:
                spr = self._plan(int(entry["n"])).steps_per_round
                if not spr:  # below fedpa.dp.min_records: no step, nothing spent
                    continue
                rounds = -(-int(entry["steps"]) // spr)
                if rounds > self.trained.get(int(c), 0):
                    self.trained[int(c)], self.sizes[int(c)], self.last = rounds, int(entry["n"]), last

    def ledger_line_ok(self, entry: dict) -> bool:
        clients = entry.get("dp_clients")
        return super().ledger_line_ok(entry) and isinstance(clients, dict) and all(
            v is None or isinstance(v, dict) and (v.get("guarantee") == "none" or isinstance(v.get("n"), int)
                                                  and isinstance(v.get("steps"), int))
            for v in clients.values()
        )


def _close(a: float, b: float) -> bool:
    """Equal up to FS's wire, which carries floats as float32 (a relative 6e-8); counts are ints and exact."""
    return abs(float(a) - float(b)) <= 1e-6 * max(abs(float(a)), abs(float(b)), 1e-12)


class SampleLevel(GaussianMechanism):
    """``fedpa.dp.mode sample``."""

    Server, Client = SampleLevelServer, SampleLevelClient

    @classmethod
    def check_run(cls, cfg, fedpa) -> None:
        super().check_run(cfg, fedpa)
        if cfg.llm.deepspeed.use:
            raise ValueError("fedpa.dp.mode sample runs its own DP-SGD step; deepspeed's engine would bypass it")
        seqcls = cfg.model.get("seqcls") if hasattr(cfg.model, "get") else None
        if seqcls is not None and seqcls.get("train_chunk"):
            raise ValueError(
                "model.seqcls.train_chunk with fedpa.dp.mode sample: DP-SGD forwards its batches in chunks of its own "
                "(fs_fedpa.plugin.dp_sgd); leave train_chunk at 0"
            )
        if fedpa.dp.label_prior and cfg.trainer.type != "seqcls":
            raise ValueError(
                f"fedpa.dp.label_prior needs a sequence classifier (trainer.type seqcls), not trainer.type "
                f"{cfg.trainer.type!r}: it corrects a classifier's logits by its label counts"
            )
        if cfg.grad.grad_clip > 0:
            message = f"grad.grad_clip(={cfg.grad.grad_clip:g}) is not applied under fedpa.dp.mode sample: each "
            message += f"example's gradient is clipped to fedpa.dp.clip(={fedpa.dp.clip:g}) instead"
            warn_once(message)

    @classmethod
    def accounting_settings(cls, cfg) -> dict:
        return {**common_settings(cfg), "dataloader.batch_size": int(cfg.dataloader.batch_size),
                "dataloader.drop_last": bool(cfg.dataloader.drop_last),
                "train.local_update_steps": int(cfg.train.local_update_steps),
                "train.batch_or_epoch": str(cfg.train.batch_or_epoch),
                # who takes steps at all, and what the clip and noise cover
                "fedpa.dp.min_records": int(cfg.fedpa.dp.min_records),
                "fedpa.dp.local_tensors": str(cfg.fedpa.dp.local_tensors),
                "fedpa.dp.label_prior": float(cfg.fedpa.dp.label_prior)}  # fmt: skip

    @classmethod
    def export_info(cls, fedpa, outdir: Path) -> dict:
        dp_files, not_dp_files = split_exports("sample")
        return {**super().export_info(fedpa, outdir), "epsilon_is": "the largest over the clients (per client in the "
                "ledger)", "local_tensors": fedpa.dp.local_tensors, "dp_files": dp_files,
                "not_dp_files": not_dp_files}  # fmt: skip


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
