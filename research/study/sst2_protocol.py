"""The SST-2 comparison protocol as data: its stages and runs, the plan that the committed results determine, and
the reading of those results (docs/study/sst2_protocol.md). The runner
(:mod:`research.study.sst2_compare`) executes the plan and the report (:mod:`research.study.report`) reads
it; both import this module, which imports neither. No torch, no FS.

Why one module over 450 lines: it is the protocol's declaration, fixed before the runs it plans; one file keeps what
was declared, and when (its git history), in one place. The DP-regime stage, declared later, has its own module.

Stages, each on ``yaml_configs/compare_sst2_protocol.yaml`` (N = 10, every client every round, LDA beta = 0.5, r = 4,
alpha = 8, local heads, 10 local steps of 16 sentences):

1. ``pilot``: FedIT for up to :data:`PILOT_ROUNDS` rounds; T = the first round at which its held-out accuracy
   gains less than 0.5 point over the last quarter of the rounds (:func:`research.study.stats.plateau_round`).
2. ``tune``: one seed, ceil(T/2) rounds, scored on a validation split held out of every client's *training* shard
   (``data.glue_holdout``; the dev set is never read). Every method over :data:`LR_GRID` (AdamW and the paper's
   plain SGD); FedPA-LoRA first over :data:`LAM_GRID` at the pilot's learning rate, then over the learning rates at
   its best λ. FedRot-LoRA keeps the paper's SST-2 strength 0.6. The selection is written to ``selected.json``.
3. ``final``: every method at exactly the values of ``selected.json``, T rounds, seeds 0-2 on the dev set under
   both evaluation protocols; seeds 3-4 for FedPA-LoRA and every baseline whose paired interval still contains 0.
   Then the grid-edge check: each method selected at the top of the AdamW grid is tuned once more one step above
   it (:data:`EDGE_LR`); the report says where that would have won. The selection is not changed.
4. ``beta``, ``hetero``, ``ablation``, ``adaptive``: the settings beyond the main cell, 3 seeds each, at the
   selected values.
5. ``head``: FedIT with its classifier head federated, seeds 0-4, T rounds (the head asymmetry).
6. ``long``: the long horizon, :data:`LONG_ARMS` over :data:`LONG_ROUNDS` rounds, seeds 0-3, with per-sentence
   outcomes of every evaluation (``fedpa.save_outcomes``).
7. ``partial``: partial participation, 100 clients, 10 sampled a round, 60 rounds, :data:`PARTIAL_ARMS`, seeds 0-2.
8. ``splits``: the client split as a factor: FedPA-LoRA and FedIT as selected, at beta 0.5 and 0.1, on the two new
   client splits of :data:`SPLIT_SEEDS` (``data.glue_split_seed``), seeds 0-2, T rounds; the committed split's runs
   are those of ``final`` and ``beta``. At beta 0.1 five more splits, :data:`MORE_SPLITS`, seeds 0-1
   (:func:`split_seeds`, :func:`split_training_seeds`).
9. ``privacy``: what differential privacy costs (DP-SGD in the main cell, tuned on the held-out split; the
   client-level mechanism in the partial setting), declared in :mod:`research.study.sst2_privacy`.
10. ``dpregime``: a regime where sample-level DP-SGD learns, and the methods there
    (:mod:`research.study.sst2_dp_regime`, which builds on this module; the runner appends its parts to :func:`plan`'s
    and prices them). Its DP runs trained the heads outside the mechanism and are withdrawn as not private.
11. ``dpvalid``: the same regime with the head inside DP-SGD's guarantee (:mod:`research.study.sst2_dp_valid`).
12. ``dpfedpa``: why FedPA-LoRA predicts one label there, and its variants inside the guarantee
    (:mod:`research.study.sst2_dp_fedpa`).

Every finished run is reduced to one small JSON file in ``--report/runs/<stage>/`` (curves and diagnostics; no
checkpoints), which is committed: a stopped grid continues where it stopped, on this machine or another. FS's own
logs stay in ``--work``. The report (``report.md``, tables, figures) is rebuilt from those files at every call.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from fs_fedpa.tasks.glue import FS_SPLIT_SEED
from research.harness import compare
from research.study import stats
from research.study.protocol_results import final_metric, paired_rows

CFG_NAME = Path("yaml_configs") / "compare_sst2_protocol.yaml"
CFG = CFG_NAME if CFG_NAME.is_file() else Path(__file__).resolve().parents[1] / CFG_NAME
REPORT = Path("docs") / "reference" / "sst2_protocol"
WORK = Path("exp") / "sst2_protocol"

HOLDOUT = 0.015  # of each client's training shard: about 1,000 SST-2 sentences in all, the size of the dev set
PILOT_ROUNDS, PILOT_LR = 48, ("AdamW", 2e-3)
LR_GRID = (("AdamW", 5e-4), ("AdamW", 2e-3), ("AdamW", 5e-3), ("SGD", 2e-2), ("SGD", 1e-1))
LAM_GRID = (0.01, 0.1, 0.5, 1.0, 2.0, 5.0)
EDGE_LR = ("AdamW", 1e-2)  # one step past the top of the AdamW grid: the check of selections at the grid's edge
BASELINES = (
    "fedit", "flexlora", "ffa_lora", "fedsa_lora", "rolora", "fedrot_lora", "fedex_lora", "flora", "lora_fair",
    "feddpa_t",
)  # fmt: skip
REFERENCES = ("local_only", "centralized")
MAIN = ("fedpa", *BASELINES, *REFERENCES)
SEEDS, MORE_SEEDS = (0, 1, 2), (3, 4)
FEDROT_STRENGTH = 0.6  # the FedRot-LoRA paper's SST-2 value, as the FedPA-LoRA paper uses it
LOCAL_STEPS = 10  # train.local_update_steps of the config; centralized LoRA takes N times as many per round
CLIENTS = 10
HETERO = {"fedpa.client_ranks": "[2, 4, 16]", "fedpa.reference_ranks": "[2, 4, 16]", "fedpa.group_sizes": "[4, 3, 3]"}
MAIN_R, HETERO_R = 4, 16  # model.seqcls.r of the config and of the heterogeneous cell (its largest r_i)
# lambda is quoted in the raw-factor scale of model.seqcls.r (lam/2 ||dW_i - X||^2 / s(r)^2, s(r) = alpha / r): the
# heterogeneous cell's r = 16 would make the selected lambda weigh the same ||dW_i - X|| (16/4)^2 = 16 times more.
# Its FedPA runs therefore use lam * (s(16) / s(4))^2 = lam / 16: the penalty per unit of update of the tuned cell.
HETERO_LAM = (MAIN_R / HETERO_R) ** 2
STAGES = (
    "pilot", "tune", "final", "ablation", "beta", "hetero", "adaptive", "head", "long", "partial", "splits", "privacy",
    "dpregime", "dpvalid", "dpfedpa",
)  # fmt: skip
# A DP-SGD step's time over a plain one's on one host (research/benchmarks/bench_dp_sgd.py: 1.12 with the batched taps,
# 1.19 with the per-example loop), for the estimate until a DP-SGD run is in. It was 4.0, from rounds timed on two
# hosts.
DP_SGD_FACTOR = 1.2
SECONDS_PER_ROUND = 28.0  # measured: 10 clients x 10 steps; used until a finished run gives a better figure


@dataclass(frozen=True)
class Run:
    """One FS run of the protocol: ``stage``, cell ``name``, ``method`` (``centralized`` is FedIT with one client
    holding all the data), its FS overrides and seed."""

    stage: str
    name: str
    method: str
    opts: tuple[str, ...]
    seed: int
    rounds: int

    @property
    def key(self) -> str:
        return f"{self.stage}/{self.name}_s{self.seed}"

    def cell(self) -> compare.Cell:
        method, extra = self.method, ()
        if method == "centralized":
            method = "fedit"
            extra = ("federate.client_num", "1", "federate.sample_client_num", "1")
            extra += ("train.local_update_steps", str(LOCAL_STEPS * CLIENTS))
        return compare.Cell(self.name, method, (*extra, *self.opts, "federate.total_round_num", str(self.rounds)))


def hparams(optimizer: str, lr: float, lam: float | None = None, method: str = "") -> tuple[str, ...]:
    opts = ("train.optimizer.type", optimizer, "train.optimizer.lr", f"{lr:g}")
    if lam is not None:
        opts += ("fedpa.lam", f"{lam:g}")
    if method == "fedrot_lora":
        opts += ("fedpa.rotation_strength", f"{FEDROT_STRENGTH:g}")
    return opts


TUNE_EVAL = ("data.glue_holdout", f"{HOLDOUT:g}", "fedpa.eval_local", "False")
FINAL_EVAL = ("data.glue_holdout", "0", "fedpa.eval_local", "True")


# ------------------------------------------------------------------------------------------------ stages
def pilot_run() -> Run:
    return Run("pilot", "fedit_pilot", "fedit", (*hparams(*PILOT_LR), *TUNE_EVAL, "eval.freq", "2"), 0, PILOT_ROUNDS)


def tune_name(method: str, optimizer: str, lr: float, lam: float | None) -> str:
    return f"{method}_{optimizer.lower()}{lr:g}" + (f"_lam{lam:g}" if lam is not None else "")


def tune_run(method: str, optimizer: str, lr: float, lam: float | None, T: int) -> Run:
    """One tuning run: seed 0, ceil(T/2) rounds, scored on the held-out split (the dev set is never read)."""
    opts = (*hparams(optimizer, lr, lam, method), *TUNE_EVAL)
    return Run("tune", tune_name(method, optimizer, lr, lam), method, opts, 0, math.ceil(T / 2))


def tune_runs(T: int, fedpa_lam: float | None) -> list[Run]:
    """The tuning grid; FedPA's learning-rate sweep needs its best λ at the pilot's rate (``fedpa_lam``)."""
    runs = []

    def add(method: str, optimizer: str, lr: float, lam: float | None = None) -> None:
        runs.append(tune_run(method, optimizer, lr, lam, T))

    for lam in LAM_GRID:
        add("fedpa", *PILOT_LR, lam)
    grid = [PILOT_LR, *(g for g in LR_GRID if g != PILOT_LR)]
    for optimizer, lr in grid:
        for method in (*BASELINES, *REFERENCES):
            add(method, optimizer, lr)
    if fedpa_lam is not None:
        for optimizer, lr in grid[1:]:
            add("fedpa", optimizer, lr, fedpa_lam)
    return runs


def tuning_table(results: dict[str, dict], runs: list[Run]) -> list[dict]:
    """One row per tuning run: method, optimizer, lr, λ and its score, the mean held-out accuracy (paper protocol)
    of its last two evaluations; None while it has not run."""
    rows = []
    for run in runs:
        opts = dict(zip(run.opts[::2], run.opts[1::2]))
        result = results.get(run.key)
        rows.append(
            {
                "method": run.method,
                "optimizer": opts["train.optimizer.type"],
                "lr": float(opts["train.optimizer.lr"]),
                "lam": float(opts["fedpa.lam"]) if "fedpa.lam" in opts else None,
                "score": score(result) if result else None,
                "run": run.key,
            }
        )
    return rows


def score(result: dict) -> float | None:
    accs = [m["val_acc"] for _, m in sorted(result["rounds"].items()) if m.get("val_acc") is not None]
    return statistics.fmean(accs[-2:]) if accs else None


def selected_opts(choice: dict) -> tuple[str, ...]:
    return hparams(choice["optimizer"], choice["lr"], choice.get("lam"), choice["method"])


def final_runs(selected: dict, T: int, seeds=SEEDS) -> list[Run]:
    return [
        Run("final", m, m, (*selected_opts(selected["methods"][m]), *FINAL_EVAL), s, T) for s in seeds for m in MAIN
    ]


def edge_runs(selected: dict, T: int) -> list[Run]:
    """The grid-edge check: every method whose selected rate is the top of the AdamW grid, tuned once more at
    :data:`EDGE_LR` (same held-out split, rounds and seed as the tuning stage; FedPA-LoRA at its selected λ). It
    never changes ``selected.json``: the report states per method whether the edge would have scored higher."""
    top = max(lr for optimizer, lr in LR_GRID if optimizer == EDGE_LR[0])
    return [
        tune_run(m, *EDGE_LR, choice.get("lam"), T)
        for m, choice in selected["methods"].items()
        if (choice["optimizer"], choice["lr"]) == (EDGE_LR[0], top)
    ]


def extra_runs(selected: dict, T: int, strongest: list[str]) -> list[Run]:
    """The ablation; β ∈ {0.1, 100} for FedPA and the strongest baselines; heterogeneous ranks; adaptive λ."""
    chosen = selected["methods"]
    runs = []

    def add(stage: str, name: str, method: str, base: str, *opts: str) -> None:
        for seed in SEEDS:
            runs.append(Run(stage, name, method, (*selected_opts(chosen[base]), *FINAL_EVAL, *opts), seed, T))

    # The ablation first: its λ = 0 and no-preservation cells test what the main cell's mechanism points to.
    add("ablation", "fedpa_no_preservation", "fedpa_no_preservation", "fedpa")
    add("ablation", "fedpa_lam0", "fedpa", "fedpa", "fedpa.lam", "0")
    for reg in ("b", "a", "both"):
        add("ablation", f"fedpa_reg_{reg}", "fedpa", "fedpa", "fedpa.reg", reg)
    add("ablation", "fedpa_no_local_head", "fedpa", "fedpa", "personalization.local_param", "[]")
    add("ablation", "fedpa_R2", "fedpa", "fedpa", "fedpa.reference_ranks", "[2]", "fedpa.group_sizes", f"[{CLIENTS}]")
    for beta in (0.1, 100):
        for method in ("fedpa", *strongest):
            add("beta", f"{method}_beta{beta:g}", method, method, "data.splitter_args", f"[{{'alpha': {beta}}}]")
    hetero = [x for k, v in HETERO.items() for x in (k, v)] + ["model.seqcls.r", str(HETERO_R)]
    lam = f"{chosen['fedpa']['lam']:g}"
    own = {  # a method's options of its own in this cell
        "fedpa": ("fedpa.lam", f"{chosen['fedpa']['lam'] * HETERO_LAM:g}"),
        "fed_plora": ("fedpa.reference_ranks", f"[{HETERO_R}, {HETERO_R}, {HETERO_R}]"),  # all R = 16 modules to all
        "ravan": ("fedpa.reference_ranks", f"[{HETERO_R}, {HETERO_R}, {HETERO_R}]"),  # all 8 heads to all
    }
    for method, base in (
        ("fedpa", "fedpa"), ("flexlora", "flexlora"), ("hetlora", "fedit"), ("flora", "flora"), ("fed_plora", "fedit"),
        ("ravan", "fedit"),
    ):  # fmt: skip
        add("hetero", f"{method}_r2_4_16", method, base, *hetero, *own.get(method, ()))
    for rule in ("loss", "grad", "direction"):
        add("adaptive", f"fedpa_adaptive_{rule}", "fedpa", "fedpa", "fedpa.adaptive_lam", rule, "fedpa.lam", lam)
    # A named variant, not the paper's rule: the grad rule's clip [0, 10] is in the paper's lambda scale (lambda_0 = 1)
    # and holds lambda_i at or near 10 = 1000 lambda_0 here; this cell keeps the paper's lambda_max / lambda_0 = 10.
    lam_max = f"{10 * chosen['fedpa']['lam']:g}"
    add("adaptive", "fedpa_adaptive_grad_scaled", "fedpa", "fedpa", "fedpa.adaptive_lam", "grad", "fedpa.lam", lam,
        "fedpa.lam_max", lam_max)  # fmt: skip
    return runs


# Issue 31, fixed before its runs. The long horizon: does the verdict of the main cell hold past T rounds, at the
# paper's lambda? Four arms, the main cell's setting otherwise; the dev set evaluated every 3 rounds (the config's
# eval.freq), both protocols, per-sentence outcomes stored; one thread a run, as the final runs ran under --jobs 2.
LONG_ROUNDS, LONG_SEEDS = 60, (0, 1, 2, 3)
LONG_ARMS = (  # cell, method, (optimizer, lr, lam) or None for the method's selected values
    ("fedit", "fedit", None),  # (a)
    ("fedpa", "fedpa", None),  # (b) AdamW 2e-3, lambda 0.01 as selected
    ("fedpa_adamw5e-3_lam1", "fedpa", ("AdamW", 5e-3, 1.0)),  # (c) FedIT's rate, the paper's SST-2 lambda
    ("fedpa_adamw5e-3_lam0.1", "fedpa", ("AdamW", 5e-3, 0.1)),  # (d)
)
LONG_REFERENCE = "fedit"  # the primary endpoint: each FedPA-LoRA arm - this arm
ENDPOINT_EVALS = 3  # the primary endpoint: the mean of a run's last this many evaluations
ONE_THREAD = ("fedpa.num_threads", "1")
# The head asymmetry: FedIT with its classifier head federated like every other trained parameter.
HEAD_CELL, HEAD_SEEDS = "fedit_no_local_head", (0, 1, 2, 3, 4)


def long_runs(selected: dict, rounds: int = LONG_ROUNDS) -> list[Run]:
    """The long-horizon stage: :data:`LONG_ARMS` x :data:`LONG_SEEDS`, :data:`LONG_ROUNDS` rounds, seed-major."""
    chosen, runs = selected["methods"], []
    for seed in LONG_SEEDS:
        for name, method, values in LONG_ARMS:
            opts = selected_opts(chosen[method]) if values is None else hparams(*values, method=method)
            extra = (*FINAL_EVAL, "fedpa.save_outcomes", "True", *ONE_THREAD)
            runs.append(Run("long", name, method, (*opts, *extra), seed, rounds))
    return runs


PARTIAL_CLIENTS, PARTIAL_SAMPLED, PARTIAL_ROUNDS, PARTIAL_EVERY, PARTIAL_SEEDS = 100, 10, 60, 6, (0, 1, 2)
PARTIAL_ARMS = (  # fixed before any run: nothing here is picked on the dev set
    ("fedpa", "fedpa", None),  # as selected
    ("fedpa_adamw5e-3_lam1", "fedpa", ("AdamW", 5e-3, 1.0)),  # the paper's SST-2 lambda at FedIT's rate
    ("fedit", "fedit", None),
    ("fedsa_lora", "fedsa_lora", None),  # the stateful baseline: it keeps its own B
)


def partial_runs(selected: dict, rounds: int = PARTIAL_ROUNDS) -> list[Run]:
    """Partial participation: :data:`PARTIAL_CLIENTS` clients by LDA (the main cell's beta), :data:`PARTIAL_SAMPLED`
    sampled a round (each trains about ``rounds * K / N`` times), every client's dev shard evaluated every
    :data:`PARTIAL_EVERY` rounds under both protocols, seeds :data:`PARTIAL_SEEDS`, :data:`PARTIAL_ARMS`."""
    chosen, runs = selected["methods"], []
    many = ("federate.client_num", str(PARTIAL_CLIENTS), "federate.sample_client_num", str(PARTIAL_SAMPLED),
            "eval.freq", str(PARTIAL_EVERY))  # fmt: skip
    for seed in PARTIAL_SEEDS:
        for name, method, values in PARTIAL_ARMS:
            opts = selected_opts(chosen[method]) if values is None else hparams(*values, method=method)
            runs.append(Run("partial", name, method, (*opts, *FINAL_EVAL, *many, *ONE_THREAD), seed, rounds))
    return runs


# Issue 41, fixed before its runs. Every earlier run shares FS's one client split (FS_SPLIT_SEED), so every interval
# is conditional on it. Two more splits, FedPA-LoRA and FedIT as selected, in the main cell and at beta = 0.1 (the one
# setting where FedPA-LoRA led on average); the committed split's runs are final/{fedpa,fedit} and
# beta/{fedpa,fedit}_beta0.1. Endpoint: the final-round dev accuracy under both protocols, as in those stages.
SPLIT_SEEDS = (FS_SPLIT_SEED, 1, 2)  # the committed split first
SPLITS_ARMS, SPLITS_BETAS = ("fedpa", "fedit"), (0.5, 0.1)  # 0.5: the main cell's
# Issue 57, fixed before its runs (2026-11-28). At beta = 0.1, where FedPA-LoRA led on every split so far, five more
# splits, each with training seeds 0-1 (the split is the unit; two seeds a split suffice), FedPA-LoRA and FedIT as
# selected, T rounds: 20 runs. Endpoint, unchanged: the final-round dev accuracy under both protocols. The primary
# comparison: FedPA-LoRA − FedIT at beta = 0.1 under the paper protocol, by the t interval on the eight split means
# (7 df; research.study.stats.split_means_interval), which generalises to new splits. With it, in one Holm family, the
# same at beta = 0.1 on the own factors, the two at beta = 0.5 (three splits), and at beta = 0.1 the deployment
# comparison (FedPA-LoRA's own adapter − FedIT's global adapter with the local head): five comparisons
# (research.study.sst2_verdict.ACROSS_SPLITS). The fixed-split interval is reported beside each, labelled as covering
# only these splits.
MORE_SPLITS, MORE_SPLITS_BETA, MORE_SPLITS_SEEDS = (3, 4, 5, 6, 7), 0.1, (0, 1)


def split_seeds(beta: float) -> tuple[int, ...]:
    """The client splits of the split stage at ``beta``: :data:`SPLIT_SEEDS`, and at beta = 0.1 :data:`MORE_SPLITS`."""
    return SPLIT_SEEDS + (MORE_SPLITS if beta == MORE_SPLITS_BETA else ())


def split_training_seeds(split: int) -> tuple[int, ...]:
    """The training seeds run on ``split``: :data:`SEEDS` on the first three splits, :data:`MORE_SPLITS_SEEDS` on
    the others."""
    return MORE_SPLITS_SEEDS if split in MORE_SPLITS else SEEDS


def splits_cell(method: str, beta: float, split: int) -> str:
    """The cell of ``method`` at ``beta`` on the split drawn by ``split``: a committed cell (``fedpa``,
    ``fedpa_beta0.1``) for :data:`FS_SPLIT_SEED`, ``<that>_split<seed>`` for the others."""
    name = method if beta == SPLITS_BETAS[0] else f"{method}_beta{beta:g}"
    return name if split == FS_SPLIT_SEED else f"{name}_split{split}"


def splits_key(method: str, beta: float, split: int, seed: int) -> str:
    """The run key of a cell of the split analysis, on the committed split in ``final``/``beta``."""
    stage = "splits" if split != FS_SPLIT_SEED else "final" if beta == SPLITS_BETAS[0] else "beta"
    return f"{stage}/{splits_cell(method, beta, split)}_s{seed}"


def splits_runs(selected: dict, T: int) -> list[Run]:
    """The new runs of the split stage: issue 41's seed-major, the two methods of one (split, beta, seed) side by
    side; then issue 57's split-major, so that each split's mean is complete as early as possible."""
    chosen = selected["methods"]

    def run(method: str, beta: float, split: int, seed: int) -> Run:
        splitter = () if beta == SPLITS_BETAS[0] else ("data.splitter_args", f"[{{'alpha': {beta}}}]")
        opts = (*selected_opts(chosen[method]), *FINAL_EVAL, *splitter, "data.glue_split_seed", str(split))
        return Run("splits", splits_cell(method, beta, split), method, (*opts, *ONE_THREAD), seed, T)

    runs = [run(m, b, split, seed) for seed in SEEDS for split in SPLIT_SEEDS[1:] for b in SPLITS_BETAS
            for m in SPLITS_ARMS]  # fmt: skip
    runs += [run(m, MORE_SPLITS_BETA, split, seed) for split in MORE_SPLITS for seed in MORE_SPLITS_SEEDS
             for m in SPLITS_ARMS]  # fmt: skip
    return runs


def head_runs(selected: dict, T: int) -> list[Run]:
    """The head asymmetry: FedIT as selected, its head federated (``personalization.local_param []``), T rounds,
    seeds :data:`HEAD_SEEDS`; paired with FedPA-LoRA's final runs and its no-local-head ablation."""
    opts = (*selected_opts(selected["methods"]["fedit"]), *FINAL_EVAL, "personalization.local_param", "[]")
    return [Run("head", HEAD_CELL, "fedit", (*opts, *ONE_THREAD), seed, T) for seed in HEAD_SEEDS]


# ------------------------------------------------------------------------------------------------ storage


def on_gpu(run: dict) -> bool:
    """Whether a run was made on a GPU host: ``use_gpu True`` among the runner's FS overrides."""
    opts = run.get("fs_opts", [])
    return dict(zip(opts[::2], opts[1::2])).get("use_gpu") == "True"


def dp_sgd(opts) -> bool:
    """Whether a run's overrides (a Run's ``opts`` or a run file's) train by DP-SGD (``fedpa.dp_mode sample``)."""
    from fs_fedpa.privacy import entry

    opts = list(opts)
    return entry(str(dict(zip(opts[::2], opts[1::2])).get("fedpa.dp_mode", "none"))).per_example


def seconds_per_round(results: dict, sample_dp: bool = False) -> float:
    """Median machine time per round of the committed CPU runs: wall time / rounds / runs side by side (--jobs);
    runs made on a GPU host (``use_gpu True`` among their FS overrides) say nothing of this machine's time. With
    ``sample_dp``, of the DP-SGD runs only (before any has run, the plain rate times :data:`DP_SGD_FACTOR`), else of
    the others. The committed runs may come from hosts of different speeds (docs/study/sst2_protocol.md)."""
    rates = [
        r["seconds"] / r["rounds_planned"] / r.get("jobs", 1)
        for r in list(results.values())  # a snapshot: the runner's threads add finished runs meanwhile
        if r.get("rounds_planned") and not on_gpu(r) and dp_sgd(r.get("opts", ())) == sample_dp
        # rounds of other sizes: priced by records (sst2_dp_regime)
        and r.get("stage") not in ("dpregime", "dpvalid", "dpfedpa")
    ]
    if rates:
        return statistics.median(rates)
    return seconds_per_round(results) * DP_SGD_FACTOR if sample_dp else SECONDS_PER_ROUND


def minutes_left(runs: list[Run], results: dict) -> float:
    """The machine minutes the runs of ``runs`` without a result will take, each priced by its kind of round."""
    rates = {kind: seconds_per_round(results, kind) for kind in (False, True)}
    return sum(r.rounds * rates[dp_sgd(r.opts)] for r in runs if r.key not in results) / 60


# ------------------------------------------------------------------------------------------------ the plan
def plan(results: dict, report: Path) -> list[tuple[str, list[Run]]]:
    """Every stage's runs as far as the committed results determine them (later stages need earlier ones)."""
    stages = [("pilot", [pilot_run()])]
    pilot = results.get(pilot_run().key)
    if pilot is None:
        return stages
    T = pilot_T(pilot)
    sweep = [r for r in tuning_table(results, tune_runs(T, None)) if r["method"] == "fedpa"]
    done = all(r["score"] is not None for r in sweep)  # FedPA's lr sweep waits for its whole λ sweep
    fedpa = stats.select(sweep).get("fedpa") if done else None
    runs = tune_runs(T, fedpa["lam"] if fedpa else None)
    stages.append(("tune", runs))
    selected_file = report / "selected.json"
    if fedpa is None or any(results.get(r.key) is None for r in runs):
        return stages
    if not selected_file.is_file():
        write_selection(tuning_table(results, runs), T, selected_file)
    selected = json.loads(selected_file.read_text())
    finals = final_runs(selected, selected["T"])
    stages.append(("final", finals))
    if any(results.get(r.key) is None for r in finals):
        return stages
    if "ties" not in selected:  # frozen once the three seeds are in, so later runs cannot change the plan
        selected["ties"] = [b for b, row in paired_rows(results, "val_acc").items() if row["verdict"] == "ties"]
        selected["strongest"] = strongest(results)
        selected_file.write_text(json.dumps(selected, indent=1) + "\n")
    more = [r for r in final_runs(selected, selected["T"], MORE_SEEDS) if r.method in ("fedpa", *selected["ties"])]
    stages.append(("final, more seeds", more))
    stages.append(("tuning grid edge", edge_runs(selected, selected["T"])))
    stages.append(("beyond the main cell", extra_runs(selected, selected["T"], selected["strongest"])))
    stages.append(("head asymmetry", head_runs(selected, selected["T"])))
    stages.append(("long horizon", long_runs(selected)))
    stages.append(("partial participation", partial_runs(selected)))
    stages.append(("client splits", splits_runs(selected, selected["T"])))
    return stages


def pilot_T(pilot: dict) -> int:
    curve = {r: m["val_acc"] for r, m in pilot["rounds"].items() if m.get("val_acc") is not None}
    return stats.plateau_round(curve)


def write_selection(rows: list[dict], T: int, path: Path) -> dict:
    """``selected.json``: T and, per method, the tuning row with the best held-out score."""
    best = stats.select(rows)
    selected = {"T": T, "holdout": HOLDOUT, "methods": {m: best[m] for m in MAIN if m in best}}
    path.write_text(json.dumps(selected, indent=1) + "\n")
    return selected


def strongest(results: dict, k: int = 3) -> list[str]:
    """The ``k`` baselines with the best mean final dev accuracy (paper protocol) over seeds."""
    means = {}
    for b in BASELINES:
        accs = [final_metric(r, "val_acc") for key, r in results.items() if key.startswith(f"final/{b}_s")]
        if accs := [a for a in accs if a is not None]:
            means[b] = statistics.fmean(accs)
    return sorted(means, key=means.get, reverse=True)[:k]


def endpoint(run: dict, metric: str, k: int = ENDPOINT_EVALS) -> float | None:
    """The mean of a run's last ``k`` evaluations of ``metric`` (the long horizon's primary endpoint)."""
    values = [m[metric] for _, m in sorted(run["rounds"].items()) if m.get(metric) is not None]
    return statistics.fmean(values[-k:]) if len(values) >= k else None


def whole_rounds(T: int) -> int:
    """Rounds of the whole protocol for a given T, taking two cells as still tied after three seeds."""
    guess = {"T": T, "methods": {m: {"method": m, "optimizer": "AdamW", "lr": 2e-3, "lam": 1.0} for m in MAIN}}
    runs = [pilot_run(), *tune_runs(T, 1.0), *final_runs(guess, T), *extra_runs(guess, T, list(BASELINES[:3]))]
    runs += [*head_runs(guess, T), *long_runs(guess)]
    edge = len(BASELINES) * math.ceil(T / 2)  # the grid-edge check, taking every baseline as selected at the edge
    return sum(r.rounds for r in runs) + len(MORE_SEEDS) * 3 * T + edge
