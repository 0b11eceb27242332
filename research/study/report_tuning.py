"""The report's sections on how the protocol was set: the pilot and its T, the tuning table, the selected values,
the grid's edges, each stage's table of paired intervals, the mechanism and λ tables."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from research.harness import compare
from research.study import protocol_results as pr
from research.study import sst2_protocol as sp
from research.study import sst2_verdict as sv
from research.study import stats
from research.study.report_text import pm as _pm
from research.study.report_text import score as _score
from research.study.report_text import HOLM_NOTE, METRICS, SPREAD_NOTE, interval, lr


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
        f"evaluations, `research.study.stats.plateau_round_smoothed`), gives **T = {smoothed}** on this pilot. "
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
        f"| {r['method']} | {lr(r)} | {_score(r['score'])} | {mark[chosen.get(r['method']) == r['run']]} |"
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
    lines = [f"| {m} | {lr(c)} | {c['score']:.4f} |" for m, c in selected["methods"].items()]
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
        lines.append(f"| {run.method} | {lr(choice)} | {choice['score']:.4f} | {_score(edge)} | {mark} |")
    return [*lines, ""]


def stage_section(title: str, stage: str, results: dict, report: Path, pairs: dict[str, str]) -> list[str]:
    """Mean ± std over seeds of the final metrics per cell, and paired intervals of (FedPA cell − cell)."""
    runs = [r for key, r in results.items() if key.startswith(f"{stage}/")]
    if not runs:
        return [f"## {title}", "", "Not run yet.", ""]
    folder = report / stage
    folder.mkdir(exist_ok=True)
    summary = compare.summarize(runs, "val_acc", larger_is_better=True)
    table_title = f"Stage `{stage}` of the SST-2 protocol (docs/study/sst2_protocol.md)."
    compare.write_table(summary, "val_acc", folder, table_title)
    try:
        from research.harness.plots import plot_all

        plot_all(runs, "val_acc", folder)
    except ImportError:  # matplotlib is an extra
        pass
    values = {m: pr.cell_values(results, m, stage) for m in METRICS}
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
        shown = [interval(intervals[m].get(cell)) for m in METRICS]
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


# The last round's diagnostics that explain a ranking (docs/study/sst2_protocol.md).
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
        accs = [a for r in group if (a := pr.final_metric(r, "val_acc")) is not None]
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
