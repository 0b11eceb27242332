"""The SST-2 protocol's report, rebuilt from the committed run files alone (:mod:`fs_fedpa.study.sst2_protocol`).

Writes into the report folder: ``report.md`` (setting, pilot, the whole tuning table, the selected values, the final
table with paired intervals against FedPA-LoRA under both evaluation protocols, the settings beyond the main cell,
the CPU time spent and what is still to run), ``tuning.csv``, and per finished stage the tables and figures of
:mod:`fs_fedpa.compare` (``final/results.md``, ``final/accuracy.png``, ``final/mechanism.png``, ...).
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from fs_fedpa import compare
from fs_fedpa.study import stats
from fs_fedpa.study import sst2_protocol as sp
from fs_fedpa.study import sst2_verdict as sv
from fs_fedpa.study.report_text import pm as _pm
from fs_fedpa.study.report_text import score as _score
from fs_fedpa.study.report_dp_regime import dp_regime_section
from fs_fedpa.study.report_privacy import privacy_section

METRICS = ("val_acc", "local.val_acc")
METRIC_NAMES = {"val_acc": "paper protocol", "local.val_acc": "own factors"}


def _interval(row: dict | None) -> str:
    if row is None:
        return "–"
    text = f"{row['mean']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}] n={row['seeds']}: FedPA {row['verdict']}"
    return text + (f"; Holm: {row['holm']} (p {row['holm_p']:.3f})" if "holm" in row else "")


HOLM_NOTE = (
    "Holm: the label after Holm's correction over one family, every comparison of the same table under the same "
    "protocol (paired t tests' p-values at the final n; the correction ignores the 3-then-5 seed rule, which adds its "
    "own chance of a spurious exclusion)."
)
SPREAD_NOTE = "mean ± sample standard deviation over seeds (n)"


def _lr(row: dict) -> str:
    return f"{row['optimizer']} {row['lr']:g}" + (f", λ {row['lam']:g}" if row.get("lam") is not None else "")


def pilot_section(results: dict) -> list[str]:
    pilot = results.get(sp.pilot_run().key)
    if pilot is None:
        return ["## Pilot", "", "Not run yet.", ""]
    curve = {r: m["val_acc"] for r, m in pilot["rounds"].items() if m.get("val_acc") is not None}
    best, lines = float("-inf"), []
    average = stats.moving_average(curve)
    for r in sorted(curve):
        best = max(best, curve[r])
        lines.append(f"| {r} | {curve[r]:.4f} | {best:.4f} | {_score(average.get(r))} |")
    T, smoothed = sp.pilot_T(pilot), stats.plateau_round_smoothed(curve)
    converged = T < max(curve)
    return [
        "## Pilot: the number of rounds T",
        "",
        f"FedIT, {sp.PILOT_LR[0]} {sp.PILOT_LR[1]:g}, seed 0, up to {sp.PILOT_ROUNDS} rounds, scored on the held-out "
        "validation split. T is the first evaluated round at which the best-so-far accuracy gains less than 0.5 "
        f"point over the last quarter of the rounds: **T = {T}**"
        + ("" if converged else " (the last round: the pilot had not converged)")
        + f"; tuning runs take ceil(T/2) = {-(-T // 2)} rounds.",
        "",
        f"Rounds here are FS's round indices, 0-based as FS logs them: the evaluation at round r follows r + 1 rounds "
        f"of training. The rule returns an index, and the protocol takes it as a number of rounds: the pilot had "
        f"trained {T + 1} rounds at its round {T}, and the later stages run T = {T} rounds (indices 0 to {T - 1}).",
        "",
        f"A second rule, which one high evaluation cannot trigger (the same rule on the mean of 3 consecutive "
        f"evaluations, `fs_fedpa.study.stats.plateau_round_smoothed`), gives **T = {smoothed}** on this pilot. "
        f"The committed protocol keeps T = {T}, the rule it was run with; the long-horizon stage asks what the "
        "rounds after it change.",
        "",
        "| round | held-out val_acc | best so far | mean of 3 evaluations |",
        "|---|---|---|---|",
        *lines,
        "",
    ]


def tuning_section(results: dict, stages: list, report: Path) -> list[str]:
    runs = next((runs for stage, runs in stages if stage == "tune"), [])
    if not runs:
        return ["## Tuning", "", "Waits for the pilot.", ""]
    rows = sp.tuning_table(results, runs)
    with open(report / "tuning.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["method", "optimizer", "lr", "lam", "score", "run"])
        writer.writeheader()
        writer.writerows(rows)
    selected_file = report / "selected.json"
    chosen = {}
    if selected_file.is_file():
        chosen = {m: c["run"] for m, c in json.loads(selected_file.read_text())["methods"].items()}
    mark = {True: "**selected**", False: ""}
    table = [
        f"| {r['method']} | {_lr(r)} | {_score(r['score'])} | {mark[chosen.get(r['method']) == r['run']]} |"
        for r in rows
    ]
    done = sum(r["score"] is not None for r in rows)
    return [
        "## Tuning on held-out training data",
        "",
        f"{done} of {len(rows)} runs done. Score: held-out accuracy (paper protocol), mean of a run's last two "
        "evaluations; the dev set is never read. `tuning.csv` has the same table.",
        "",
        "| method | optimizer, lr, λ | score | |",
        "|---|---|---|---|",
        *table,
        "",
    ]


def selected_section(report: Path) -> list[str]:
    path = report / "selected.json"
    if not path.is_file():
        return ["## Selected hyper-parameters", "", "Written when the tuning stage is complete.", ""]
    selected = json.loads(path.read_text())
    lines = [f"| {m} | {_lr(c)} | {c['score']:.4f} |" for m, c in selected["methods"].items()]
    return [
        "## Selected hyper-parameters (`selected.json`; the final runs read them from there)",
        "",
        f"T = {selected['T']} rounds.",
        "",
        "| method | optimizer, lr, λ | held-out score |",
        "|---|---|---|",
        *lines,
        "",
    ]


def edge_section(results: dict, stages: list, report: Path) -> list[str]:
    """The grid-edge check: per method selected at the top of the AdamW grid, its selected score beside its score one
    step above (:data:`sp.EDGE_LR`), tuned the same way. The selection is not changed by it."""
    runs = next((runs for stage, runs in stages if stage == "tuning grid edge"), [])
    path = report / "selected.json"
    if not runs or not path.is_file():
        return []
    chosen = json.loads(path.read_text())["methods"]
    lines = [
        "## The tuning grid's edge",
        "",
        f"Methods selected at the top of the AdamW grid, tuned once more at {sp.EDGE_LR[0]} {sp.EDGE_LR[1]:g} (same "
        'held-out split, seed and rounds). "higher": the edge scored above the selected rate, so that method\'s '
        "best rate may lie beyond the grid and its final runs may understate it; the selection is not changed.",
        "",
        f"| method | selected | held-out score | {sp.EDGE_LR[0]} {sp.EDGE_LR[1]:g} | |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        choice, result = chosen[run.method], results.get(run.key)
        edge = sp.score(result) if result else None
        mark = "–" if edge is None else ("higher" if edge > choice["score"] else "selection holds")
        lines.append(f"| {run.method} | {_lr(choice)} | {choice['score']:.4f} | {_score(edge)} | {mark} |")
    return [*lines, ""]


def stage_section(title: str, stage: str, results: dict, report: Path, pairs: dict[str, str]) -> list[str]:
    """Mean ± std over seeds of the final metrics per cell, and paired intervals of (FedPA cell − cell)."""
    runs = [r for key, r in results.items() if key.startswith(f"{stage}/")]
    if not runs:
        return [f"## {title}", "", "Not run yet.", ""]
    folder = report / stage
    folder.mkdir(exist_ok=True)
    summary = compare.summarize(runs, "val_acc", larger_is_better=True)
    compare.write_table(summary, "val_acc", folder, f"Stage `{stage}` of the SST-2 protocol (docs/sst2_protocol.md).")
    try:
        from fs_fedpa.plots import plot_all

        plot_all(runs, "val_acc", folder)
    except ImportError:  # matplotlib is an extra
        pass
    values = {m: sp.cell_values(results, m, stage) for m in METRICS}
    lines = [
        f"## {title}",
        "",
        f"Final round, {SPREAD_NOTE}; `{stage}/results.md` has the best round and the diagnostics, "
        f"`{stage}/*.png` the curves. Interval: paired 95% t interval of (FedPA-LoRA − cell) over shared seeds. "
        + HOLM_NOTE,
        "",
        "| cell | val_acc (paper protocol) | local.val_acc | FedPA − cell, paper protocol | FedPA − cell, own "
        "factors |",
        "|---|---|---|---|---|",
    ]
    intervals = {m: sv.family_rows(results, values[m], pairs, m) for m in METRICS}
    for cell in dict.fromkeys(r["cell"] for r in runs):
        means = [_pm(list(values[m].get(cell, {}).values())) for m in METRICS]
        shown = [_interval(intervals[m].get(cell)) for m in METRICS]
        lines.append(f"| {cell} | {means[0]} | {means[1]} | {shown[0]} | {shown[1]} |")
    if stage != "final":  # the final stage has a section of its own, "The mechanism"
        lines += ["", 'The last round\'s diagnostics, as in "The mechanism" above:', "", *mechanism_table(runs)]
    if stage == "adaptive":
        lines += lambda_trajectory(runs)
    return [*lines, ""]


def lambda_trajectory(runs: list[dict]) -> list[str]:
    """Per cell whose runs recorded the clients' λ (``lam_mean``, ``lam_min``, ``lam_max`` of
    :func:`fs_fedpa.record.compact`): λ_i^(t) at the first, middle and last aggregated round (mean over clients,
    then over seeds), the last round's range over clients and seeds, and the mean over rounds."""
    rows = []
    for cell in dict.fromkeys(r["cell"] for r in runs):
        series = [[d for d in r.get("diagnostics", []) if "lam_mean" in d] for r in runs if r["cell"] == cell]
        series = [s for s in series if s]
        if not series:
            continue
        n = min(len(s) for s in series)
        at = [statistics.mean(s[i]["lam_mean"] for s in series) for i in (0, (n - 1) // 2, n - 1)]
        low, high = min(s[n - 1]["lam_min"] for s in series), max(s[n - 1]["lam_max"] for s in series)
        overall = statistics.mean(statistics.mean(d["lam_mean"] for d in s[:n]) for s in series)
        rounds = [series[0][i].get("round", i) for i in (0, (n - 1) // 2, n - 1)]
        cells = " | ".join(f"{v:.3g} (round {r})" for v, r in zip(at, rounds))
        rows.append(f"| {cell} | {len(series)} | {cells} | {low:.3g} – {high:.3g} | {overall:.3g} |")
    if not rows:
        return []
    return [
        "",
        "The λ_i^(t) each rule chose (mean over clients, then over seeds; the fixed-λ cell has one λ throughout):",
        "",
        "| cell | seeds | first round | middle round | last round | last round, range over clients | mean over "
        "rounds |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def verdict_section(results: dict) -> list[str]:
    """The plain verdict of the main cell: per baseline, FedPA-LoRA wins, ties or loses under each protocol, raw and
    after Holm's correction; how many spurious exclusions the seed rule leaves to chance; the near-duplicates."""
    rows = {m: sp.with_holm(sp.paired_rows(results, m)) for m in METRICS}
    cells = sorted(set(rows[METRICS[0]]) | set(rows[METRICS[1]]))
    if not cells:
        return ["## Verdict", "", "Written when the final runs of FedPA-LoRA and a baseline share two seeds.", ""]
    lines = ["## Verdict (final runs, dev set)", "", "| against | paper protocol | own factors |", "|---|---|---|"]
    for cell in cells:
        lines.append(f"| {cell} | " + " | ".join(_interval(rows[m].get(cell)) for m in METRICS) + " |")
    note = "FedPA-LoRA − cell, mean [95% paired t interval] over shared seeds; wins / ties / loses as the interval "
    lines += ["", note + "lies above, across or below 0. " + HOLM_NOTE, ""]
    sds = [sd for m in METRICS for sd in _paired_sds(results, m).values()]
    if sds:
        rate, expected = stats.seed_rule_exclusions(sds, sims=SIMULATIONS, seed=0)
        lines += [
            f"**By chance alone.** Under the null (no true difference), the protocol's seed rule (3 seeds, 2 more "
            f"where the interval contains 0) gives each comparison a {100 * rate:.1f}% chance of an interval that "
            f"excludes 0 (Monte Carlo, {SIMULATIONS:,} draws, normal differences with the {len(sds)} comparisons' "
            f"observed paired standard deviations), so about **{expected:.1f}** of these {len(sds)} intervals are "
            "expected to exclude 0 spuriously.",
            "",
        ]
    if groups := sp.near_duplicates(results):
        named = "; ".join(", ".join(g) for g in groups)
        lines += [
            f"**Near-duplicates:** {named}: their per-seed final accuracies (paper protocol) lie within "
            f"{100 * sp.NEAR:.1f} point of each other in every seed, so their intervals against FedPA-LoRA are one "
            "finding, not several.",
            "",
        ]
    return lines


SIMULATIONS = 200_000  # draws of the seed-rule simulation (fixed seed 0)


def _paired_sds(results: dict, metric: str) -> dict[str, float]:
    """Per final-stage cell, the standard deviation of its paired differences with FedPA-LoRA at its final n."""
    return {cell: row["sd"] for cell, row in sp.paired_rows(results, metric).items()}


def head_section(results: dict) -> list[str]:
    """The head asymmetry: FedIT with its classifier head federated (stage ``head``) against FedPA-LoRA's final runs
    (local head), FedPA-LoRA's no-local-head ablation (both without) and FedIT's own final runs (with)."""
    runs = [r for key, r in results.items() if key.startswith("head/")]
    title = "## The head asymmetry: FedIT without a local head"
    if not runs:
        return [title, "", "Not run yet.", ""]
    rows = {m: sv.head_intervals(results, m) for m in METRICS}
    values = {m: list(sp.cell_values(results, m, "head").get(sp.HEAD_CELL, {}).values()) for m in METRICS}
    lines = [
        title,
        "",
        f"`{sp.HEAD_CELL}`: FedIT as selected with `personalization.local_param []`, so the server averages the "
        f"classifier head like every other trained parameter; T rounds, the main cell otherwise. Final round: "
        f"{_pm(values['val_acc'])} (paper protocol), {_pm(values['local.val_acc'])} (own factors). Paired 95% t "
        "intervals over shared seeds (the ablation has seeds 0-2); wins / ties / loses: the first cell's. "
        + HOLM_NOTE,
        "",
        "| difference | paper protocol | own factors |",
        "|---|---|---|",
    ]
    for label, *_ in sv.HEAD_COMPARISONS:
        shown = [_interval(rows[m].get(label)).replace("FedPA ", "first ") for m in METRICS]
        lines.append(f"| {label} | {shown[0]} | {shown[1]} |")
    return [*lines, ""]


def _arm_runs(results: dict, report: Path, stage: str, arms: tuple) -> tuple[list[dict], Path]:
    """The runs of a stage of fixed arms, in arm then seed order, and its figures' folder (made when it has runs)."""
    order = [name for name, _, _ in arms]
    runs = sorted((r for key, r in results.items() if key.startswith(f"{stage}/")),
                  key=lambda r: (order.index(r["cell"]), r["seed"]))  # fmt: skip
    folder = report / stage
    if runs:
        folder.mkdir(exist_ok=True)
    return runs, folder


def long_section(results: dict, report: Path) -> list[str]:
    """The long horizon: the four arms' curves (figure), their endpoints with paired t and bootstrap intervals
    against FedIT, and the check that its first T rounds reproduce the committed final runs."""
    runs, folder = _arm_runs(results, report, "long", sp.LONG_ARMS)
    title = f"## The long horizon: {sp.LONG_ROUNDS} rounds"
    if not runs:
        return [title, "", "Not run yet.", ""]
    try:
        from fs_fedpa.study.plots import plot_protocols

        plot_protocols(runs, "val_acc", folder / "curves.png")
    except ImportError:  # matplotlib is an extra
        pass
    lines = [
        title,
        "",
        f"Four arms fixed before the runs, seeds {sp.LONG_SEEDS[0]}-{sp.LONG_SEEDS[-1]}, {sp.LONG_ROUNDS} rounds, "
        f"the dev set every 3 rounds under both protocols, the main cell otherwise. Primary endpoint: per arm, the "
        f"mean of a run's last {sp.ENDPOINT_EVALS} evaluations; per FedPA-LoRA arm, the paired difference arm − "
        f"{sp.LONG_REFERENCE} with its 95% t interval over seeds (Holm over the three arms) and a paired bootstrap "
        "interval that resamples seeds and, independently, dev sentences within each client's shard "
        "(`fs_fedpa.study.stats.paired_bootstrap`, 10,000 draws): a statement about SST-2 sentences, not only these "
        f"872. `long/curves.png`: the curves, {SPREAD_NOTE}.",
        "",
        *_long_endpoints(results, runs),
        *_long_curve_table(runs),
        f'The mechanism at the last round (round {sp.LONG_ROUNDS - 1}), as in "The mechanism": per arm, best '
        "paper-protocol accuracy first, the last round's diagnostics, mean over seeds (the gradient ratio: median).",
        "",
        *mechanism_table(runs),
        "",
        *_reproduction(results, runs),
    ]
    return lines


def _long_endpoints(results: dict, runs: list[dict]) -> list[str]:
    """Per arm: its endpoint under both protocols and, for the FedPA-LoRA arms, arm − reference (t and bootstrap)."""
    arms: dict[str, dict[int, dict]] = {}
    for run in runs:
        arms.setdefault(run["cell"], {})[run["seed"]] = run
    reference = arms.get(sp.LONG_REFERENCE, {})
    endpoints = {m: sp.cell_values(results, m, "long", sp.endpoint) for m in METRICS}
    intervals = {m: sv.long_intervals(results, m) for m in METRICS}
    lines = [
        f"| arm | endpoint, paper protocol | endpoint, own factors | arm − {sp.LONG_REFERENCE}, paper protocol: t; "
        "bootstrap | own factors: t; bootstrap |",
        "|---|---|---|---|---|",
    ]
    for cell, seeds in arms.items():
        shown = [_pm(list(endpoints[m].get(cell, {}).values())) for m in METRICS]
        for m, protocol_name in zip(METRICS, ("global", "local")):
            if cell == sp.LONG_REFERENCE:
                shown.append("–")
                continue
            row = intervals[m].get(cell)
            boot = _bootstrap(seeds, reference, protocol_name)
            text = "–" if row is None else _interval(row).replace("FedPA ", "arm ")
            shown.append(
                text + ("" if boot is None else f"; {boot[0]:+.4f} [{boot[1]:+.4f}, {boot[2]:+.4f}] n={boot[3]}")
            )
        lines.append(f"| {cell} | " + " | ".join(shown) + " |")
    note = (
        "t: paired 95% t interval over the n seed pairs; bootstrap: 95% percentile interval of the paired bootstrap "
        "over the n seed pairs whose per-sentence outcomes are stored."
    )
    return [*lines, "", note + " " + HOLM_NOTE, ""]


def _bootstrap(arm: dict[int, dict], reference: dict[int, dict], protocol_name: str) -> tuple | None:
    """The paired bootstrap of arm − reference over their shared seeds, from the stored per-sentence outcomes:
    ``(mean, low, high, seeds used)``."""
    seeds = sorted(s for s in set(arm) & set(reference) if "outcomes" in arm[s] and "outcomes" in reference[s])
    if not seeds:
        return None
    x, y, strata = [], [], None
    for s in seeds:
        xs, sx = sp.sentence_scores(arm[s], protocol_name)
        ys, sy = sp.sentence_scores(reference[s], protocol_name)
        if sx != sy or (strata is not None and sx != strata):
            raise ValueError(f"seed {s}: the arms' dev shards differ; a paired bootstrap needs the same split")
        x.append(xs)
        y.append(ys)
        strata = sx
    return (*stats.paired_bootstrap(x, y, strata, draws=10_000, seed=0), len(seeds))


CURVE_ROUNDS = (20, 29, 38, 47, 59)  # where the long horizon's table samples the curves (FS round indices)


def _long_curve_table(runs: list[dict]) -> list[str]:
    head = " | ".join(f"round {r}" for r in CURVE_ROUNDS)
    lines = [f"| arm, val_acc (paper protocol), mean (n) | {head} |", "|---|" + "---|" * len(CURVE_ROUNDS)]
    for cell in dict.fromkeys(r["cell"] for r in runs):
        group = [r for r in runs if r["cell"] == cell]
        cells = []
        for rnd in CURVE_ROUNDS:
            values = [r["rounds"][rnd]["val_acc"] for r in group if rnd in r["rounds"]]
            cells.append(f"{statistics.fmean(values):.4f} ({len(values)})" if values else "–")
        lines.append(f"| {cell} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _reproduction(results: dict, runs: list[dict]) -> list[str]:
    """Arms fedit and fedpa must reproduce the committed final runs (same seed, values, threads) up to their last
    round: the largest difference of any evaluation of either protocol."""
    worst, compared = 0.0, 0
    for run in runs:
        final = results.get(f"final/{run['cell']}_s{run['seed']}")
        if final is None or run["cell"] not in ("fedit", "fedpa"):
            continue
        for rnd, metrics in final["rounds"].items():
            for m in METRICS:
                if m in metrics and rnd in run["rounds"]:
                    worst = max(worst, abs(run["rounds"][rnd][m] - metrics[m]))
                    compared += 1
    if not compared:
        return []
    verdict = "every one equal" if worst == 0 else f"largest difference {worst:.2e}"
    return [
        f"**Reproduction check.** Arms fedit and fedpa against the committed final runs of the same seeds, every "
        f"evaluation of both protocols up to the final runs' last round ({compared} values): {verdict}.",
        "",
    ]


DEV_SENTENCES = 872  # the SST-2 dev set: FS's weighted val_total of an evaluation is this over the clients evaluated
STALENESS_EDGES = (1, 3, 6, 11, 21)  # bins [1, 3), [3, 6), ..., [21, inf): round means are not whole numbers


def partial_section(results: dict, report: Path) -> list[str]:
    """Partial participation: each arm's final evaluation under both protocols, the paired intervals of each
    FedPA-LoRA arm against the baselines, where each run ran, and drift at a returning client's start against the
    rounds it sat out (figure and table)."""
    runs, folder = _arm_runs(results, report, "partial", sp.PARTIAL_ARMS)
    title = f"## Partial participation: {sp.PARTIAL_CLIENTS} clients, {sp.PARTIAL_SAMPLED} sampled a round"
    if not runs:
        return [title, "", "Not run yet.", ""]
    try:
        from fs_fedpa.study.plots import plot_protocols, plot_staleness

        plot_protocols(runs, "val_acc", folder / "curves.png")
        plot_staleness(runs, folder / "staleness.png")
    except ImportError:  # matplotlib is an extra
        pass
    seeds = sorted({r["seed"] for r in runs})
    times = sp.PARTIAL_ROUNDS * sp.PARTIAL_SAMPLED // sp.PARTIAL_CLIENTS
    lines = [
        title,
        "",
        f"LDA β = 0.5 over {sp.PARTIAL_CLIENTS} clients, {sp.PARTIAL_SAMPLED} sampled a round, "
        f"{sp.PARTIAL_ROUNDS} rounds (a client trains about {times} times), every client's dev shard evaluated "
        f"every {sp.PARTIAL_EVERY} rounds under both protocols; arms "
        f"fixed before the runs; seeds run so far: {', '.join(map(str, seeds))} of "
        f"{', '.join(map(str, sp.PARTIAL_SEEDS))}. Endpoint as in the main cell: the final evaluation. "
        "`partial/curves.png`: the curves; `partial/staleness.png`: drift against staleness.",
        "",
        *_where_runs_ran(runs),
        "| arm | val_acc (paper protocol) | local.val_acc | clients evaluated |",
        "|---|---|---|---|",
    ]
    values = {m: sp.cell_values(results, m, "partial") for m in METRICS}
    for cell in dict.fromkeys(r["cell"] for r in runs):
        counts = sorted({round(DEV_SENTENCES / v) for r in runs if r["cell"] == cell
                         for v in [sp.final_metric(r, "val_total")] if v})  # fmt: skip
        shown = [_pm(list(values[m].get(cell, {}).values())) for m in METRICS]
        lines.append(f"| {cell} | {shown[0]} | {shown[1]} | {', '.join(map(str, counts))} of {sp.PARTIAL_CLIENTS} |")
    lines += ["", "Clients evaluated: those with a non-empty dev shard (SST-2 dev size over FS's weighted val_total); "
              "the others are skipped by FS and counted here.", ""]  # fmt: skip
    lines += _partial_pairs(results, len(seeds))
    lines += _staleness_table(runs)
    return lines


def _where_runs_ran(runs: list[dict]) -> list[str]:
    places: dict[str, list[str]] = {}
    for run in runs:
        where = "GPU" if sp.on_gpu(run) else "CPU"
        places.setdefault(f"{where}, torch {run.get('torch') or '?'}", []).append(f"{run['cell']} s{run['seed']}")
    text = "; ".join(f"{place}: {', '.join(names)}" for place, names in places.items())
    return [
        f"Where the runs ran: {text}. A seed's arms ran on one machine, so every paired difference is between runs of "
        "one device and torch build (they change results from the rounding level on). The GPU runs read MiniLM "
        "weights that travelled to the GPU host as fp16 and were widened back to fp32 there.",
        "",
    ]


def _partial_pairs(results: dict, n_seeds: int) -> list[str]:
    """Each FedPA-LoRA arm − each baseline arm, per protocol; Holm over the whole table under one protocol."""
    ours = [name for name, method, _ in sp.PARTIAL_ARMS if method == "fedpa"]
    others = [name for name, method, _ in sp.PARTIAL_ARMS if method != "fedpa"]
    lines = ["| FedPA-LoRA arm − baseline | paper protocol | own factors |", "|---|---|---|"]
    shown = sv.partial_intervals(results)
    for arm in ours:
        for other in others:
            row = [_interval(shown[m].get((arm, other))).replace("FedPA ", "arm ") for m in METRICS]
            lines.append(f"| {arm} − {other} | {row[0]} | {row[1]} |")
    note = "Paired 95% t interval over seeds. " + HOLM_NOTE
    if n_seeds < 2:
        note = f"No interval yet: {n_seeds} seed run, a paired interval needs 2. " + note
    return [*lines, "", note, ""]


def _staleness_table(runs: list[dict]) -> list[str]:
    """Mean drift at round start per staleness bin and arm, over every returning client of every round and seed."""
    from fs_fedpa.study.plots import stale_drift

    bins = list(zip(STALENESS_EDGES, (*STALENESS_EDGES[1:], None)))
    head = " | ".join(f"staleness [{low}, {high or '∞'})" for low, high in bins)
    lines = [
        "Drift at a returning client's round start, ‖s_i B_i A_i − X_g,i‖_F over all modules, by the rounds it sat "
        "out: mean (points). For FedIT this is the product it discards when it loads the global factors.",
        "",
        f"| arm | {head} |",
        "|---|" + "---|" * len(bins),
    ]
    for cell in dict.fromkeys(r["cell"] for r in runs):
        points, kinds = [], set()
        for run in (r for r in runs if r["cell"] == cell):
            found, per_client = stale_drift(run)
            points += found
            kinds.add(per_client)
        cells = []
        for low, high in bins:
            inside = [d for st, d in points if low <= st and (high is None or st < high)]
            cells.append(f"{statistics.fmean(inside):.3f} ({len(inside)})" if inside else "–")
        name = cell if kinds == {True} else f"{cell} (round means{'' if kinds == {False} else ', in part'})"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def splits_section(results: dict) -> list[str]:
    """The client split as a factor: per beta and protocol, FedPA-LoRA − FedIT on each split; across splits the t
    interval on the split means (new splits) and the fixed-split interval (these splits only), the split's variance
    component, and the stage's comparisons with Holm over them (:data:`fs_fedpa.study.sst2_verdict.ACROSS_SPLITS`)."""
    title = "## The client split as a factor"
    found = {(b, m): sv.split_analysis(results, b, m) for b in sp.SPLITS_BETAS for m in METRICS}
    if not any(len(f["splits"]) > 1 for f in found.values()):
        return [title, "", "Not run yet.", ""]
    lines = [
        title,
        "",
        f"FedPA-LoRA − FedIT, both as selected, final-round dev accuracy; T rounds, the main cell otherwise. Client "
        f"splits (`data.glue_split_seed`): {sp.FS_SPLIT_SEED} (FS's own, the committed runs) and "
        f"{', '.join(map(str, sp.SPLIT_SEEDS[1:]))} with training seeds {sp.SEEDS[0]}-{sp.SEEDS[-1]} at both β; at "
        f"β = {sp.MORE_SPLITS_BETA:g} also {', '.join(map(str, sp.MORE_SPLITS))} with seeds "
        f"{', '.join(map(str, sp.MORE_SPLITS_SEEDS))}. Per split: the paired 95% t interval over its seeds and in how "
        "many seeds FedPA-LoRA is ahead. Across splits: the t interval on the split means, k − 1 df "
        "(`fs_fedpa.study.stats.split_means_interval`), which generalises to a new client split; beside it the "
        "fixed-split interval (within-split mean square, N − k df; `fixed_split_interval`), which covers only the "
        "splits run here; and the one-way random-effects decomposition of the paired differences by split "
        "(`fs_fedpa.study.stats.split_variance`, ANOVA moments; sd in points).",
        "",
    ]
    for beta in sp.SPLITS_BETAS:
        lines += [f"**β = {beta:g}**", "", "| split | paper protocol | own factors |", "|---|---|---|"]
        for split in sp.split_seeds(beta):
            cells = []
            for m in METRICS:
                row = found[(beta, m)]["splits"].get(split)
                if row is None:
                    cells.append("–")
                    continue
                text = f"{row['mean']:+.4f}"
                if "low" in row:
                    text += f" [{row['low']:+.4f}, {row['high']:+.4f}] {row['verdict']}"
                cells.append(text + f"; n={row['n']}, ahead in {row['ahead']}")
            lines.append(f"| {split} | {cells[0]} | {cells[1]} |")
        across = [found[(beta, m)] for m in METRICS]
        if all("across" in f for f in across):
            lines.append(f"| across splits, new splits: t on the split means ({across[0]['across']['df']} df) | "
                         + " | ".join(_interval_text(f["across"]) for f in across) + " |")  # fmt: skip
            lines.append(f"| these splits only: fixed-split t ({across[0]['fixed']['df']} df) | "
                         + " | ".join(_interval_text(f["fixed"]) for f in across) + " |")  # fmt: skip
            lines.append("| split variance: sd_split, sd_seed (points); F, p (df); ratio σ²_split/σ²_seed, 95% | "
                         + " | ".join(_variance_text(f["variance"]) for f in across) + " |")  # fmt: skip
            if across[0]["across"]["splits"] > len(sp.SPLIT_SEEDS):  # issue 57's are in: issue 41's stays printed
                first = [sv.split_analysis(results, beta, m, splits=sp.SPLIT_SEEDS)["across"] for m in METRICS]
                lines.append(f"| issue 41's three splits only: t on the split means ({first[0]['df']} df) | "
                             + " | ".join(_interval_text(f) for f in first) + " |")  # fmt: skip
                if len(sp.split_seeds(beta)) > across[0]["across"]["splits"]:
                    lines.append(f"| (interim: {across[0]['across']['splits']} of the {len(sp.split_seeds(beta))} "
                                 "declared splits are in; the declared endpoint needs all of them) | | |")
        lines.append("")
    family = sv.across_split_rows(results)
    if family:
        lines += [
            f"The stage's across-split comparisons, one Holm family of {len(family)} (fixed before issue 57's runs; "
            "t on the split means):",
            "",
            "| comparison | splits | FedPA-LoRA − FedIT, mean [95% t] | p | Holm p | Holm | issue 41's three splits |",
            "|---|---|---|---|---|---|---|",
        ]
        for (label, beta, ours, theirs), row in ((c, family[c[0]]) for c in sv.ACROSS_SPLITS if c[0] in family):
            first = sv.split_analysis(results, beta, ours, theirs, splits=sp.SPLIT_SEEDS).get("across")
            three = f"{first['mean']:+.4f} [{first['low']:+.4f}, {first['high']:+.4f}]" if first else "–"
            lines.append(f"| {label} | {row['splits']} | {row['mean']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}] "
                         f"| {row['p']:.3f} | {row['holm_p']:.3f} | {row['holm']} | {three} |")  # fmt: skip
        lines.append("")
    runs = [r for k, r in results.items() if k.startswith("splits/")]
    gpu = sorted(f"{r['cell']} s{r['seed']}" for r in runs if sp.on_gpu(r))
    if gpu:
        lines += [f"Where the runs ran: {len(runs) - len(gpu)} of the stage's {len(runs)} runs on this project's CPU, "
                  f"{len(gpu)} side by side on a lent GPU host (torch {_torch_of(runs, True)}, MiniLM carried as fp16 "
                  f"and widened to float32 there): {', '.join(gpu)}. Runs of one device and build differ from the "
                  "other's from the rounding level on; a pair whose two runs ran on different devices: "
                  f"{_mixed_pairs(runs) or 'none'}.", ""]  # fmt: skip
    lines += [
        "With three splits the split component has 2 degrees of freedom: its 95% interval (the ratio column, exact "
        "under normality) runs from no split effect to one many times the seed variance, so a split component of "
        "zero cannot be told from a large one. That is why the across-split interval is the t on the split means: "
        "it is exact whatever the ratio (a nested bootstrap over three splits covered 0.78-0.94 at this design), "
        "and why the fixed-split interval, narrower where splits differ, is no statement about a new split. "
        "Protocol drift, said plainly: issue 41 declared survival by the per-split signs and intervals; the "
        "across-split interval and Holm over the section were added after its runs, and issue 57 fixed the family "
        "above before its own.",
        "",
    ]
    return lines


def _interval_text(row: dict) -> str:
    return f"{row['mean']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}] {row['verdict']}, p {row['p']:.3f}"


def _torch_of(runs: list[dict], on_gpu: bool) -> str:
    return ", ".join(sorted({str(r.get("torch")) for r in runs if sp.on_gpu(r) == on_gpu})) or "?"


def _mixed_pairs(runs: list[dict]) -> str:
    """The (cell without its method, seed) pairs whose FedPA-LoRA and FedIT runs ran on different devices."""
    where: dict[tuple[str, int], set[bool]] = {}
    for r in runs:
        where.setdefault((r["cell"].split("_", 1)[1], r["seed"]), set()).add(sp.on_gpu(r))
    return ", ".join(f"{cell} s{seed}" for (cell, seed), places in sorted(where.items()) if len(places) > 1)


def _variance_text(v: dict) -> str:
    text = f"{100 * v['var_split'] ** 0.5:.2f}, {100 * v['var_seed'] ** 0.5:.2f}"
    if "F" in v:
        text += f"; F {v['F']:.2f}, p {v['p']:.2f} ({v['df_between']}, {v['df_within']})"
    if "ratio_low" in v:
        text += f"; [{v['ratio_low']:.2f}, {v['ratio_high']:.1f}]"
    return text


def deployment_section(results: dict) -> list[str]:
    """Which model to give client i: fixed pairs across the two protocols, paired by seed, Holm over the table."""
    rows = sv.deployment_rows(results)
    if not rows:
        return []
    lines = [
        "## One model per client: which to deploy",
        "",
        "A user who deploys one model per client asks which to give client i: FedPA-LoRA's own adapter (its own "
        "factors and head, `local.val_acc`) or FedIT's global adapter with the client's local head (`val_acc`), or "
        "either method's other model. Fixed pairs, never the better of two picked on the dev set they are judged "
        "on; paired by seed (a seed's runs share the split and the initialisation); endpoint as in each setting's "
        "section. One Holm family: the whole table, since its comparisons cross the protocols.",
        "",
        "| setting | comparison | first − second, mean [95% t] n: raw; Holm |",
        "|---|---|---|",
    ]
    for setting, label, row in rows:
        lines.append(f"| {setting} | {label} | " + _interval(row).replace("FedPA ", "first ") + " |")
    return [*lines, ""]


def verdict_figure(results: dict, report: Path) -> list[str]:
    """``verdict.png``: every setting's FedPA-LoRA − baseline intervals under both protocols."""
    rows = sv.verdict_rows(results)
    if not rows:
        return []
    try:
        from fs_fedpa.study.plots import plot_verdict

        plot_verdict(rows, report / "verdict.png")
    except ImportError:  # matplotlib is an extra
        return []
    return [
        "![verdict](verdict.png)",
        "",
        "`verdict.png`: FedPA-LoRA − baseline per setting, in points, paired 95% t intervals (across client splits: "
        "the t interval on the split means); green: the interval lies above 0, red: below, grey: across; a filled "
        "dot: the label survives Holm's correction in its family (the across-split rows: the splits section's).",
        "",
    ]


# The last round's diagnostics that explain a ranking (docs/sst2_protocol.md).
MECHANISM = (
    ("global_update_norm", "‖Σ w_i ΔW_i‖"),
    ("delta_norm_mean", "mean ‖ΔW_i‖"),
    ("coherence", "coherence"),
    ("drift_rel_mean", "drift / ‖X_g,i‖"),
    ("e_agg_rel", "E_agg_rel"),
    ("grad_ratio_last_mean", "‖∇align‖ / ‖∇task‖"),
)
# One batch's task gradient can be near zero, so this ratio is heavy-tailed (0.5-58 over FedPA-LoRA's five seeds):
# across seeds it is summarised by the median, every other diagnostic by the mean.
MEDIAN_OVER_SEEDS = ("grad_ratio_last_mean",)


def _mechanism_cells(values: dict[str, float]) -> str:
    """The :data:`MECHANISM` columns of one table row; – where a diagnostic was not recorded."""
    return " | ".join(f"{values[k]:.3g}" if k in values else "–" for k, _ in MECHANISM)


def last_round_mechanism(run: dict) -> dict[str, float]:
    """The last round's mechanism diagnostics of one run, with coherence = ‖Σ w_i ΔW_i‖ / mean_i ‖ΔW_i‖: 1 when
    every client moves the same way, about 1/√N when N clients move in unrelated directions."""
    last = run["diagnostics"][-1] if run.get("diagnostics") else {}
    out = {k: float(last[k]) for k, _ in MECHANISM if isinstance(last.get(k), (int, float))}
    if out.get("global_update_norm") == 0.0:  # a method whose server aggregates no product (FedSA-LoRA: A only)
        out.pop("global_update_norm")
        out.pop("e_agg_rel", None)
    if out.get("delta_norm_mean") and "global_update_norm" in out:
        out["coherence"] = out["global_update_norm"] / out["delta_norm_mean"]
    return out


def mechanism_table(runs: list[dict]) -> list[str]:
    """Per cell of ``runs``, best paper-protocol accuracy first: its final accuracy (mean over seeds) beside the last
    round's :data:`MECHANISM` diagnostics (mean over seeds; :data:`MEDIAN_OVER_SEEDS` by the median)."""
    rows = []
    for cell in dict.fromkeys(r["cell"] for r in runs):
        group = [r for r in runs if r["cell"] == cell]
        accs = [a for r in group if (a := sp.final_metric(r, "val_acc")) is not None]
        diags = [last_round_mechanism(r) for r in group]
        means = {k: [d[k] for d in diags if k in d] for k, _ in MECHANISM}
        means = {k: statistics.median(v) if k in MEDIAN_OVER_SEEDS else sum(v) / len(v) for k, v in means.items() if v}
        acc = sum(accs) / len(accs) if accs else float("nan")
        rows.append((acc, cell, len(group), means))
    rows.sort(key=lambda row: -row[0])
    head = " | ".join(label + " (median)" * (k in MEDIAN_OVER_SEEDS) for k, label in MECHANISM)
    lines = [f"| cell | seeds | val_acc | {head} |", "|---|---|---|" + "---|" * len(MECHANISM)]
    return lines + [f"| {cell} | {n} | {acc:.4f} | {_mechanism_cells(means)} |" for acc, cell, n, means in rows]


def mechanism_section(results: dict) -> list[str]:
    """Per final cell, best accuracy first: its accuracy beside the last round's mechanism diagnostics."""
    runs = [r for key, r in results.items() if key.startswith("final/")]
    if not runs:
        return []
    return [
        "## The mechanism (final runs, last round)",
        "",
        "Per cell, best paper-protocol accuracy first; each diagnostic is the last round's value, mean over seeds "
        "(the gradient ratio, heavy-tailed: median over seeds; client fields: mean over clients first). "
        "‖Σ w_i ΔW_i‖: the update the server aggregates; coherence: that "
        "norm over the mean client update ‖ΔW_i‖ (1 when all clients move alike, about 1/√N when they move in "
        "unrelated directions); drift: ‖ΔW_i − X_g,i‖ from the reference the client received, over ‖X_g,i‖; "
        "E_agg_rel: what the server's global factors lose of Σ w_i ΔW_i (– for both where the server aggregates no "
        "product); the gradient ratio at the round's last step (FedPA-LoRA's "
        "alignment term). `final/mechanism.png` has the curves over rounds.",
        "",
        *mechanism_table(runs),
        "",
    ]


LAMBDA_ANCHORS = ("fedit", "local_only")  # full coupling through the server, and none


def lambda_section(results: dict, stages: list) -> list[str]:
    """FedPA-LoRA's λ sweep of the tuning stage (at the pilot's learning rate) beside FedIT and local training at the
    same rate: each run's held-out score with its last round's mechanism diagnostics, so the λ selected can be read
    off what the alignment term does to the updates."""
    runs = next((runs for stage, runs in stages if stage == "tune"), [])
    rows = [
        row
        for row in sp.tuning_table(results, runs)
        if (row["optimizer"], row["lr"]) == sp.PILOT_LR
        and row["method"] in ("fedpa", *LAMBDA_ANCHORS)
        and row["score"] is not None
    ]
    if not any(row["method"] == "fedpa" for row in rows):
        return []
    rows.sort(key=lambda row: (row["method"] != "fedpa", row["lam"] or 0.0, row["method"]))
    head = " | ".join(label for _, label in MECHANISM)
    lines = [
        "## FedPA-LoRA's λ in the tuning runs",
        "",
        f"Tuning stage, {sp.PILOT_LR[0]} {sp.PILOT_LR[1]:g}, seed 0, {runs[0].rounds} rounds: the "
        "held-out score and the last round's diagnostics (as in the mechanism table above) per λ, with FedIT and "
        "local training at the same learning rate. The alignment term is λ/(2 s(r)²)·‖ΔW_i − X_g,i‖²_F with "
        's(r) = α/r (docs/algorithm.md, "LoRA scaling").',
        "",
        f"| cell | held-out score | {head} |",
        "|---|---|" + "---|" * len(MECHANISM),
    ]
    for row in rows:
        means = last_round_mechanism(results[row["run"]])
        name = f"fedpa, λ {row['lam']:g}" if row["method"] == "fedpa" else row["method"]
        lines.append(f"| {name} | {row['score']:.4f} | {_mechanism_cells(means)} |")
    return [*lines, ""]


def write_report(report: Path, results: dict, stages: list) -> Path:
    report.mkdir(parents=True, exist_ok=True)
    spent = sp.time_spent(results)
    pending = [(stage, sum(r.key not in results for r in runs)) for stage, runs in stages]
    finals = {r["cell"] for k, r in results.items() if k.startswith("final/")}
    lines = [
        "# SST-2 protocol: results",
        "",
        "Rebuilt by `./run.sh compare` from the run files in `runs/` (docs/sst2_protocol.md describes the protocol).",
        f"Time of the committed runs: {spent} (2 cores). Runs still to do: "
        + (", ".join(f"{s}: {n}" for s, n in pending if n) or "none of the stages known now")
        + ".",
        "",
        *verdict_figure(results, report),
        *verdict_section(results),
        *deployment_section(results),
        *pilot_section(results),
        *tuning_section(results, stages, report),
        *selected_section(report),
        *edge_section(results, stages, report),
        *stage_section("Final runs (dev set)", "final", results, report, {c: "fedpa" for c in finals}),
        *mechanism_section(results),
        *lambda_section(results, stages),
        *stage_section("Data heterogeneity: β = 0.1 and 100", "beta", results, report, sv.beta_pairs(results)),
        *stage_section("Heterogeneous ranks r_i ∈ {2, 4, 16}", "hetero", results, report, sv.hetero_pairs(results)),
        *stage_section("Ablation (against the final FedPA-LoRA runs)", "ablation", results | _finals(results), report,
                       {c: "fedpa" for k, r in results.items() if k.startswith("ablation/") for c in [r["cell"]]}),
        *stage_section("Adaptive λ (Appendix F; against fixed λ)", "adaptive", results | _finals(results), report,
                       {c: "fedpa" for k, r in results.items() if k.startswith("adaptive/") for c in [r["cell"]]}),
        *head_section(results),
        *long_section(results, report),
        *partial_section(results, report),
        *splits_section(results),
        *privacy_section(results, stages),
        *dp_regime_section(results, stages, report),
    ]  # fmt: skip
    path = report / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _finals(results: dict) -> dict:
    """The final FedPA-LoRA runs re-keyed into another stage, as the reference of the ablation and adaptive cells."""
    return {f"{stage}/{k.split('/', 1)[1]}": r for k, r in results.items() if k.startswith("final/fedpa_s")
            for stage in ("ablation", "adaptive")}  # fmt: skip
