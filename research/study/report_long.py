"""The report's sections on time: the long horizon (60 rounds, endpoints, curves, the reproduction of the final
runs) and partial participation (staleness and drift)."""

from __future__ import annotations

import statistics
from pathlib import Path

from research.study import protocol_results as pr
from research.study import sst2_protocol as sp
from research.study import sst2_verdict as sv
from research.study import stats
from research.study.report_text import pm as _pm
from research.study.report_text import HOLM_NOTE, METRICS, SPREAD_NOTE, interval
from research.study.report_tuning import mechanism_table


def _arm_runs(results: dict, report: Path, stage: str, arms: tuple) -> tuple[list[dict], Path]:
    """The runs of a stage of fixed arms, in arm then seed order, and its figures' folder; when it has runs, the
    folder is made and holds ``curves.png``, the arms' curves under both protocols."""
    order = [name for name, _, _ in arms]
    runs = sorted((r for key, r in results.items() if key.startswith(f"{stage}/")),
                  key=lambda r: (order.index(r["cell"]), r["seed"]))  # fmt: skip
    folder = report / stage
    if runs:
        folder.mkdir(exist_ok=True)
        try:
            from research.study.plots import plot_protocols

            plot_protocols(runs, "val_acc", folder / "curves.png")
        except ImportError:  # matplotlib is an extra
            pass
    return runs, folder


def long_section(results: dict, report: Path) -> list[str]:
    """The long horizon: the four arms' curves (figure), their endpoints with paired t and bootstrap intervals
    against FedIT, and the check that its first T rounds reproduce the committed final runs."""
    runs, folder = _arm_runs(results, report, "long", sp.LONG_ARMS)
    title = f"## The long horizon: {sp.LONG_ROUNDS} rounds"
    if not runs:
        return [title, "", "Not run yet.", ""]
    lines = [
        title,
        "",
        f"Four arms fixed before the runs, seeds {sp.LONG_SEEDS[0]}-{sp.LONG_SEEDS[-1]}, {sp.LONG_ROUNDS} rounds, "
        f"the dev set every 3 rounds under both protocols, the main cell otherwise. Primary endpoint: per arm, the "
        f"mean of a run's last {sp.ENDPOINT_EVALS} evaluations; per FedPA-LoRA arm, the paired difference arm − "
        f"{sp.LONG_REFERENCE} with its 95% t interval over seeds (Holm over the three arms) and a paired bootstrap "
        "interval that resamples seeds and, independently, dev sentences within each client's shard "
        "(`research.study.stats.paired_bootstrap`, 10,000 draws): a statement about SST-2 sentences, not only these "
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
    endpoints = {m: pr.cell_values(results, m, "long", sp.endpoint) for m in METRICS}
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
            text = "–" if row is None else interval(row).replace("FedPA ", "arm ")
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
        xs, sx = pr.sentence_scores(arm[s], protocol_name)
        ys, sy = pr.sentence_scores(reference[s], protocol_name)
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
        from research.study.plots import plot_staleness

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
    values = {m: pr.cell_values(results, m, "partial") for m in METRICS}
    for cell in dict.fromkeys(r["cell"] for r in runs):
        counts = sorted({round(DEV_SENTENCES / v) for r in runs if r["cell"] == cell
                         for v in [pr.final_metric(r, "val_total")] if v})  # fmt: skip
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
            row = [interval(shown[m].get((arm, other))).replace("FedPA ", "arm ") for m in METRICS]
            lines.append(f"| {arm} − {other} | {row[0]} | {row[1]} |")
    note = "Paired 95% t interval over seeds. " + HOLM_NOTE
    if n_seeds < 2:
        note = f"No interval yet: {n_seeds} seed run, a paired interval needs 2. " + note
    return [*lines, "", note, ""]


def _staleness_table(runs: list[dict]) -> list[str]:
    """Mean drift at round start per staleness bin and arm, over every returning client of every round and seed."""
    from research.study.plots import stale_drift

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
