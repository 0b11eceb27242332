"""The ``dpvalid`` stage of the SST-2 protocol (issue 71): the dpregime stage re-measured in a treatment of the
client's head that keeps DP-SGD's guarantee. Declared on 2026-12-01, before any of its runs; nothing here is read from
the dev set. No torch, no FS.

Why: the dpregime stage trained each client's head on the batch's exact gradient (``fedpa.dp_local_tensors plain``),
outside the mechanism; through the head one record moved every other record's clipped gradient, so its ε = 8 was no
guarantee and its DP runs are withdrawn (docs/privacy.md). ``plain`` is refused now.

Fixed for every run: the dpregime stage's selected regime (:mod:`research.study.sst2_dp_regime`: b = 256 Poisson-
sampled records a step, τ = 1, 120 rounds, LoRA on MiniLM's top two layers over the prefix cache, AdamW with a
linear warm-up over 12 steps, clients under 1,000 sentences taking no DP step, CPU chunks of 32), DP-SGD at ε = 8 per
client with Poisson sampling, add/remove adjacency and the PLD accountant, δ = min(1e-5, 1/(10 n_i)); each client's
head local (``personalization.local_param ['classifier']``). The ledgers also give every run's ε read as replace-one
(its Poisson sampling kept, PLD).

Before the runs, ``research/scripts/dp_signal_noise.py --heads frozen noised --clips 0.1 --lr 5e-3`` (one client of
8,000 training sentences, z = 0.62) measured the frozen head at C = 0.1: a record's gradient is about 0.01, inside C,
and the noise is 2.7-3.2 times the clipped sum per step over 30 steps, the train loss not falling. So the search tries
a clip that binds too.

The search (FedIT, seed 0, the held-out split; score :func:`research.study.sst2_protocol.score`):

S1. head ∈ :data:`HEADS` (``noised``: clipped and noised with the factors; ``frozen``: held at its initial value)
    × C ∈ :data:`CLIPS`, at AdamW 5e-3 (the rate the dpregime search selected): 4 runs.
S2. At S1's best (head, C): AdamW at each rate of :data:`LRS`: 2 runs.

The gate: the best search run's held-out score must exceed :data:`GATE`, the shard-majority score the dpregime
stage's runs sat at on this held-out split (0.7545; one label per client's shard) plus one point. If it does not,
the finals do not run, and the docs say what was tried and why it fails, from the noise/signal measurements.

The finals, at the best search run's (head, C, rate), on the dev set, seeds 0-2: FedPA-LoRA (the main cell's λ),
FedIT, FFA-LoRA and FedSVD under DP, each against itself without DP in the same head treatment (``noised``: the head
trains; ``frozen``: DP-SGD's own path with the head held and its clip and noise off, C = :data:`OFF_CLIP`, z =
:data:`OFF_Z`, whose ε is meaningless), and the central anchors (one client with every training sentence, with DP
and without, one seed). Endpoint: dev accuracy at the last round. Comparisons: FedPA-LoRA against each other method
under DP (Holm over 3), each method under DP against itself without (Holm over 4); paired over seeds, t intervals.

Diagnostics beside the finals (declared, single seed, dev set, not selecting): ``fedpa_no_preservation`` under DP (the
restart, nothing else changed), and FedPA-LoRA under DP at λ ∈ :data:`DIAG_LAMS`. Declared on 2026-12-02, before
their runs: ``fedpa_dp_refit`` and ``fedit_dp_refit``, seed 0's DP finals of FedPA-LoRA and FedIT again with
``fedpa.eval_refit_head`` (after the last upload, both protocols are also scored with each client's head refitted
without DP on its training shard: the evaluation mismatch, outside the guarantee). The refit leaves training alone, so
their other scores must equal the seed-0 finals' (a check the report prints).

A diagnostic closes most of FedPA-LoRA's gap under DP when, at seed 0, it recovers at least half of it
(:func:`closing`): the gap is fedit_dp − fedpa_dp (paper protocol); a diagnostic run's score is its paper-protocol
accuracy, and for the refit its better protocol with the refitted head, against FedIT's refitted paper protocol. Each
diagnostic that does is run at seeds 1-2 too (with its FedIT counterpart for the refit), a FedPA-LoRA variant under DP
against FedIT under DP on seeds 0-2, paired t intervals, Holm over the variants that run (:func:`followup_runs`).

Part E′ (declared on 2026-12-02, before its runs; independent of the gate, since it is client-level DP): FedPA-LoRA in
the dpregime stage's cross-device setting (:mod:`research.study.sst2_dp_device`: N = 2,000, K = 400, 30 rounds, the
head federated), scoring each client's own adapter (``fedpa.eval_local True``, ``local.val_acc``) beside the global
adapter, without DP and with client-level DP at ε = 8 (replace-one, K of N sampled, RDP as in part E). Under
client-level DP a client's own factors never leave it, so its own adapter carries no noise of its own; only the
received reference and the head do. C = the median contribution of the committed part-E run ``device_fedpa`` (the
stage's rule (b)), which also stands as the global adapter's no-DP figure. Part E's amendment (no DP run for a method
whose no-DP global adapter stayed at one label) does not apply: the own adapters are the endpoint here. Endpoint:
dev accuracy at the last round, own and global, against FedIT's part-E runs (0.779 without DP, 0.776 with). One seed:
a measurement, not a test; no ranking is claimed from it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from research.study import protocol_results as pr
from research.study import sst2_dp_device as dd
from research.study import sst2_dp_regime as dr
from research.study import sst2_privacy as spriv
from research.study import sst2_protocol as sp

STAGE = "dpvalid"
HEADS, CLIPS, LRS = ("noised", "frozen"), (0.1, 0.01), (2e-3, 1e-2)
FIRST_LR = 5e-3
GATE = 0.7545 + 0.01
OFF_CLIP, OFF_Z = 1e6, 1e-9  # a frozen head's run without DP: DP-SGD's path, the clip never binding, no noise
DIAG_LAMS = (0.1, 1.0)
REFIT = ("fedpa.eval_refit_head", "True")
REFIT_METRICS = ("refit.val_acc", "local.refit.val_acc")
REGIME = dr.Regime(256, 1, "local", (4, 5), "AdamW", FIRST_LR, 0.1)  # the dpregime stage's selection, its head aside


@dataclass(frozen=True)
class Valid:
    """One search point: the head's treatment, the clip C and AdamW's rate, in :data:`REGIME`."""

    head: str
    clip: float
    lr: float

    @property
    def regime(self) -> dr.Regime:
        return replace(REGIME, lr=self.lr, clip=self.clip)

    @property
    def name(self) -> str:
        return f"{self.head}_c{self.clip:g}_lr{self.lr:g}"

    def opts(self) -> tuple[str, ...]:
        """The FS overrides without DP (the head local; a frozen head is held by DP-SGD, see :meth:`off_opts`)."""
        return self.regime.opts()

    def dp_opts(self) -> tuple[str, ...]:
        """DP-SGD at ε = 8 (Poisson, add/remove, PLD) with this head treatment."""
        opts = self.regime.dp_opts()  # ends with the dpregime stage's withdrawn head, replaced here
        assert opts[-2:] == ("fedpa.dp_local_tensors", "plain"), opts
        return (*opts[:-2], "fedpa.dp_local_tensors", self.head)

    def off_opts(self) -> tuple[str, ...]:
        """Without DP in the same head treatment: nothing for ``noised`` (the head trains), DP-SGD's path with the
        clip and noise off for ``frozen`` (the only way to hold the head)."""
        if self.head == "noised":
            return dr.chunk_opts(False)
        off = replace(self, clip=OFF_CLIP)
        opts = dict(zip(off.dp_opts()[::2], off.dp_opts()[1::2]))
        opts.pop("fedpa.dp_epsilon")
        opts.pop("fedpa.dp_horizon")
        opts |= {"fedpa.dp_noise_multiplier": f"{OFF_Z:g}", "fedpa.dp_accountant": "rdp",
                 "fedpa.dp_min_records": "0"}  # fmt: skip
        return (*(x for kv in opts.items() for x in kv), *dr.chunk_opts(True))

    @classmethod
    def of(cls, name: str) -> Valid:
        head, clip, lr = name.split("_")
        return cls(head, float(clip[1:]), float(lr[2:]))


def _search_run(point: Valid) -> sp.Run:
    opts = (*point.opts(), *point.dp_opts(), *dr.chunk_opts(True), *sp.TUNE_EVAL)
    return sp.Run(STAGE, f"search_{point.name}", dr.REFERENCE, opts, 0, REGIME.rounds)


def search_1() -> list[sp.Run]:
    return [_search_run(Valid(head, clip, FIRST_LR)) for head in HEADS for clip in CLIPS]


def search_2(best_1: Valid) -> list[sp.Run]:
    return [_search_run(replace(best_1, lr=lr)) for lr in LRS]


def point_of(run: sp.Run) -> Valid:
    return Valid.of(run.name[len("search_") :])


def final_runs(point: Valid, fedpa_lam: float) -> list[sp.Run]:
    """The finals (seed-major) and the central anchors, in ``point`` (the diagnostics: :func:`diagnostic_runs`)."""
    base = (*point.opts(), *sp.FINAL_EVAL)
    private, off = (*point.dp_opts(), *dr.chunk_opts(True)), point.off_opts()
    runs = []
    for seed in dr.SEEDS:
        for method in dr.METHODS:
            lam = ("fedpa.lam", f"{fedpa_lam:g}") if method == "fedpa" else ()
            runs.append(sp.Run(STAGE, method, method, (*base, *lam, *off), seed, REGIME.rounds))
            runs.append(sp.Run(STAGE, f"{method}_dp", method, (*base, *lam, *private), seed, REGIME.rounds))
    one = ("federate.client_num", "1", "federate.sample_client_num", "1")
    for cell, extra in (("central", off), ("central_dp", private)):
        runs.append(sp.Run(STAGE, cell, "fedit", (*base, *one, *extra), dr.CENTRAL_SEED, REGIME.rounds))
    return runs


def diagnostic_runs(point: Valid, fedpa_lam: float) -> list[sp.Run]:
    base = (*point.opts(), *sp.FINAL_EVAL, *point.dp_opts(), *dr.chunk_opts(True))
    runs = [sp.Run(STAGE, "fedpa_no_preservation_dp", "fedpa_no_preservation", (*base, "fedpa.lam", f"{fedpa_lam:g}"),
                   0, REGIME.rounds)]  # fmt: skip
    for lam in DIAG_LAMS:
        runs.append(sp.Run(STAGE, f"fedpa_dp_lam{lam:g}", "fedpa", (*base, "fedpa.lam", f"{lam:g}"), 0, REGIME.rounds))
    return [*runs, *(_refit_run(point, method, fedpa_lam, 0) for method in ("fedpa", "fedit"))]


def _refit_run(point: Valid, method: str, fedpa_lam: float, seed: int) -> sp.Run:
    """The DP final of ``method`` at ``seed`` (its options, in its order), scored after the last upload with the heads
    refitted too."""
    final = next(r for r in final_runs(point, fedpa_lam) if r.name == f"{method}_dp" and r.seed == seed)
    return replace(final, name=f"{method}_dp_refit", opts=(*final.opts, *REFIT))


def comparator(name: str) -> str:
    """The run a diagnostic (or its follow-up) is compared with under DP: FedIT's refit for the refit, else FedIT."""
    return "fedit_dp_refit" if name == "fedpa_dp_refit" else "fedit_dp"


def _score(result: dict | None, metrics: tuple[str, ...]) -> float | None:
    values = [v for m in metrics if result and (v := pr.final_metric(result, m)) is not None]
    return max(values) if values else None


def closing(results: dict, point: Valid, fedpa_lam: float) -> list[str]:
    """The names of the diagnostics that recover at least half of FedPA-LoRA's seed-0 gap to FedIT under DP
    (module docstring); [] until the runs it reads are in."""
    at = {r.name: results.get(r.key) for r in (*final_runs(point, fedpa_lam), *diagnostic_runs(point, fedpa_lam))
          if r.seed == 0}  # fmt: skip
    ours, fedit = _score(at.get("fedpa_dp"), ("val_acc",)), _score(at.get("fedit_dp"), ("val_acc",))
    if ours is None or fedit is None or fedit <= ours:
        return []
    gap, found = fedit - ours, []
    for run in diagnostic_runs(point, fedpa_lam):
        if run.name == "fedit_dp_refit":
            continue
        if run.name == "fedpa_dp_refit":
            mine, theirs = _score(at.get(run.name), REFIT_METRICS), _score(at.get("fedit_dp_refit"), REFIT_METRICS[:1])
        else:
            mine, theirs = _score(at.get(run.name), ("val_acc",)), fedit
        if mine is not None and theirs is not None and theirs - mine <= gap / 2:
            found.append(run.name)
    return found


def refit_metric(results: dict, point: Valid, fedpa_lam: float) -> str:
    """FedPA-LoRA's protocol with the refitted head that scored higher at seed 0: fixed before seeds 1-2 run."""
    run = next(r for r in diagnostic_runs(point, fedpa_lam) if r.name == "fedpa_dp_refit")
    result = results.get(run.key)
    scores = {m: v for m in REFIT_METRICS if result and (v := pr.final_metric(result, m)) is not None}
    return max(scores, key=scores.get) if scores else REFIT_METRICS[0]


def followup_values(results: dict, point: Valid, fedpa_lam: float) -> dict[str, dict[int, float]]:
    """cell -> seed -> score of each variant :func:`closing` names and of its comparator under DP (``fedit_dp``;
    for the refit ``fedit_dp_refit``'s refitted paper protocol), over seeds 0-2 as far as they are in."""
    runs = [*final_runs(point, fedpa_lam), *diagnostic_runs(point, fedpa_lam)]
    runs += followup_runs(results, point, fedpa_lam)
    metric = {"fedpa_dp_refit": refit_metric(results, point, fedpa_lam), "fedit_dp_refit": REFIT_METRICS[0]}
    found = closing(results, point, fedpa_lam)
    wanted = {"fedit_dp", *found, *map(comparator, found)}
    values: dict[str, dict[int, float]] = {}
    for run in runs:
        if run.name in wanted and (v := _score(results.get(run.key), (metric.get(run.name, "val_acc"),))) is not None:
            values.setdefault(run.name, {})[run.seed] = v
    return values


def followup_runs(results: dict, point: Valid, fedpa_lam: float) -> list[sp.Run]:
    """Seeds 1-2 of each diagnostic that :func:`closing` names (the refit with FedIT's)."""
    by_name = {r.name: r for r in diagnostic_runs(point, fedpa_lam)}
    runs = []
    for name in closing(results, point, fedpa_lam):
        for seed in dr.SEEDS[1:]:
            if name == "fedpa_dp_refit":
                runs += [_refit_run(point, m, fedpa_lam, seed) for m in ("fedpa", "fedit")]
            else:
                runs.append(replace(by_name[name], seed=seed))
    return runs


def device_runs(selected_main: dict, results: dict) -> list[sp.Run]:
    """Part E′: FedPA-LoRA's own adapters in the cross-device client-level setting, without DP, and with DP once the
    committed part-E run that sets C is in."""
    part_e = dd.plain_run(selected_main, "fedpa")
    opts = dict(zip(part_e.opts[::2], part_e.opts[1::2])) | {"fedpa.eval_local": "True"}
    flat = tuple(x for kv in opts.items() for x in kv)
    runs = [sp.Run(STAGE, "device_fedpa_own", "fedpa", flat, dd.SEED, dd.ROUNDS)]
    clip = spriv.median_contribution(results.get(part_e.key), "fedpa")
    if clip is not None:
        runs.append(sp.Run(STAGE, "device_fedpa_own_dp", "fedpa", (*flat, *spriv.client_dp(clip, dd.EPSILON)), dd.SEED,
                           dd.ROUNDS))  # fmt: skip
    return runs


def selected(results: dict) -> tuple[list[sp.Run], list[sp.Run] | None, sp.Run | None]:
    """S1's runs, S2's once S1 is in, and the best search run once both are (None before)."""
    first = search_1()
    top_1 = dr.best(results, first)
    if top_1 is None:
        return first, None, None
    second = search_2(point_of(top_1))
    return first, second, dr.best(results, [top_1, *second])


def passes_gate(results: dict, top: sp.Run | None) -> bool:
    value = sp.score(results[top.key]) if top is not None else None
    return value is not None and value > GATE


def runs(selected_main: dict, results: dict) -> list[tuple[str, list[sp.Run]]]:
    """The stage's parts as far as the committed results determine them; no finals unless the gate passes."""
    first, second, top = selected(results)
    parts = [("dp valid: search S1 (head, clip)", first)]
    if second is not None:
        parts.append(("dp valid: search S2 (rate)", second))
    if passes_gate(results, top):
        lam = selected_main["methods"]["fedpa"]["lam"]
        parts.append(("dp valid: finals", final_runs(point_of(top), lam)))
        parts.append(("dp valid: diagnostics (not selecting)", diagnostic_runs(point_of(top), lam)))
        if more := followup_runs(results, point_of(top), lam):
            parts.append(("dp valid: the diagnostics that close the gap, seeds 1-2", more))
    parts.append(("dp valid: part E′, FedPA-LoRA's own adapters cross-device", device_runs(selected_main, results)))
    return parts


def stage_hours(fedpa_lam: float = 0.01) -> float:
    """The whole stage's CPU hours here before any run (the frozen head's finals, which cost the same as noised)."""
    point = Valid("frozen", 0.1, FIRST_LR)
    everything = [*search_1(), *search_2(point), *final_runs(point, fedpa_lam), *diagnostic_runs(point, fedpa_lam)]
    return (dr.minutes(everything, {}) + 2 * dd.cpu_seconds(sp.Run(STAGE, "device", "fedpa", (), dd.SEED, dd.ROUNDS))
            / 60) / 60
