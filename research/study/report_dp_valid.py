"""The report's section on the ``dpvalid`` stage (:mod:`research.study.sst2_dp_valid`): the search and its gate, the
finals under DP against themselves without DP in the same head treatment (Holm over the four DP costs) and
FedPA-LoRA against each other method under DP (Holm over three), the diagnostics, part E′. No torch, no FS."""

from __future__ import annotations

import statistics

from research.study import protocol_results as pr
from research.study import sst2_dp_regime as dr
from research.study import sst2_dp_valid as dv
from research.study import sst2_protocol as sp
from research.study.report_dp_regime import family_comparisons, other_reading
from research.study.report_text import METRIC_NAMES, METRICS
from research.study.report_text import pm as _pm

OTHERS = tuple(m for m in dr.METHODS if m != "fedpa")


def families() -> tuple[tuple[str, dict[str, tuple[str, str]]], ...]:
    """(title, {label: (cell, cell it is compared with)}) of each Holm family, declared with the stage."""
    return (
        ("FedPA-LoRA against each other method under DP (Holm over 3)",
         {f"fedpa_dp − {m}_dp": ("fedpa_dp", f"{m}_dp") for m in OTHERS}),
        ("each method under DP against itself without DP, the DP cost (Holm over 4)",
         {f"{m}_dp − {m}": (f"{m}_dp", m) for m in dr.METHODS}),
    )  # fmt: skip


def comparisons(results: dict, metric: str) -> dict[str, dict]:
    """Every row of :func:`families` under ``metric`` (:func:`~research.study.report_dp_regime.family_comparisons`)."""
    return family_comparisons(pr.cell_values(results, metric, dv.STAGE), families())


def holm_interval(row: dict | None) -> str:
    """A paired row in accuracy points with its n and Holm label (or that its family is not complete)."""
    if row is None:
        return "–"
    holm = f"; Holm p {row['holm_p']:.3f}, {row['holm']}" if "holm" in row else "; Holm: the family is not complete"
    return f"{100 * row['mean']:+.1f} [{100 * row['low']:+.1f}, {100 * row['high']:+.1f}] (n={row['seeds']}){holm}"


def search_lines(results: dict) -> list[str]:
    first, second, top = dv.selected(results)
    lines = ["Search (FedIT, seed 0, the held-out split; score: the mean of the last two evaluations):", "",
             "| run | held-out accuracy by evaluation | score | macro-F1, last |", "|---|---|---|---|"]  # fmt: skip
    for run in [*first, *(second or [])]:
        result = results.get(run.key)
        if result is None:
            lines.append(f"| {run.name} | – | – | – |")
            continue
        accs = ", ".join(f"{m['val_acc']:.4f}" for _, m in sorted(result["rounds"].items()) if "val_acc" in m)
        last = result["rounds"][max(result["rounds"])].get("val_f1")
        lines.append(f"| {run.name} | {accs} | {sp.score(result):.4f} | {'–' if last is None else f'{last:.3f}'} |")
    if top is not None:
        verdict = "passes" if dv.passes_gate(results, top) else "does not pass"
        lines += ["", f"The best, {top.name} ({sp.score(results[top.key]):.4f}), {verdict} the declared gate "
                  f"({dv.GATE:.4f}).", ""]  # fmt: skip
    return lines


def final_lines(results: dict) -> list[str]:
    cells = [c for m in dr.METHODS for c in (f"{m}_dp", m)] + ["central_dp", "central"]
    values = {metric: pr.cell_values(results, metric, dv.STAGE) for metric in METRICS}
    lines = ["Finals (dev set, accuracy at the last round, mean ± sample sd over seeds (n)); the frozen head's cells "
             "without DP run DP-SGD's path with the clip and the noise off:", "",
             "| cell | paper protocol | own factors | ε (ledger: Poisson, add/remove, PLD; largest client) | "
             "the same noise read as replace-one, its Poisson sampling kept (PLD; smallest–largest client) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for cell in cells:
        runs = [r for k, r in results.items() if k.startswith(f"{dv.STAGE}/{cell}_s")]
        eps = [r["privacy"]["dp_epsilon"] for r in runs if (r.get("privacy") or {}).get("dp_epsilon") is not None]
        private = cell.endswith("_dp")
        shown = f"{max(eps):.2f}" if eps and private else "–"
        other = [e for r in runs for e in other_reading(r)] if private else []
        lines.append(f"| {cell} | {_pm(list(values['val_acc'].get(cell, {}).values()))} | "
                     f"{_pm(list(values['local.val_acc'].get(cell, {}).values()))} | {shown} | "
                     f"{f'{min(other):.2f}–{max(other):.2f}' if other else '–'} |")  # fmt: skip
    for metric in METRICS:
        rows = comparisons(results, metric)
        for title, family in families():
            lines += ["", f"{title}, {METRIC_NAMES[metric]}: paired 95% t intervals over seeds, in accuracy points.",
                      "", "| comparison | interval |", "|---|---|"]  # fmt: skip
            lines += [f"| {key} | {holm_interval(rows.get(key))} |" for key in family]
    return [*lines, ""]


def single_lines(results: dict, runs: list[sp.Run], title: str, refit: bool = False) -> list[str]:
    """One row a run: its last-round accuracy by protocol (``refit``: also with the heads refitted)."""
    metrics = (*METRICS, *(dv.REFIT_METRICS if refit else ()))
    head = " | ".join([*METRIC_NAMES.values(), *(("paper, head refitted, outside the guarantee", "own, head refitted, outside the guarantee") if refit else ())])
    lines = [title, "", f"| run | {head} |", "|---" * (len(metrics) + 1) + "|"]
    for run in runs:
        result = results.get(run.key)
        acc = {m: pr.final_metric(result, m) if result else None for m in metrics}
        lines.append(f"| {run.name} | " + " | ".join("–" if v is None else f"{v:.4f}" for v in acc.values()) + " |")
    return [*lines, ""]


def refit_check(results: dict, point: dv.Valid, lam: float) -> list[str]:
    """Each refit run's own scores beside its seed-0 DP final's (the refit must leave training alone).

    Equal scores are the check only where the DP noise is seeded (``fedpa.dp_seed``); the stage's runs draw it from
    the OS's generator (the default, -1), so a refit run is a second draw of the noise and its scores are shown
    beside the final's instead of compared."""
    lines = []
    for run in (r for r in dv.diagnostic_runs(point, lam) if r.name.endswith("_refit")):
        final = dv.STAGE + "/" + run.name[: -len("_refit")] + "_s0"
        mine, theirs = results.get(run.key), results.get(final)
        if mine is None or theirs is None:
            continue
        pairs = [(pr.final_metric(mine, m), pr.final_metric(theirs, m)) for m in METRICS]
        if "fedpa.dp_seed" in run.opts[::2]:
            verdict = "equal" if all(a == b for a, b in pairs) else "DIFFER from"
            lines.append(f"- {run.name}: its scores without the refit {verdict} its seed-0 DP final's.")
            continue
        shown = ", ".join(f"{name} {a:.4f} against {b:.4f}" for name, (a, b) in zip(METRIC_NAMES.values(), pairs))
        lines.append(f"- {run.name}, without the refit: {shown} in its seed-0 DP final (a second draw of the DP "
                     "noise, which comes from the OS's generator: equal scores are not expected).")
    return [*lines, ""] if lines else []


def closing_lines(results: dict, point: dv.Valid, lam: float) -> list[str]:
    """The declared screen (which diagnostics recover half the gap) and the follow-up comparisons it starts."""
    found = dv.closing(results, point, lam)
    values = dv.followup_values(results, point, lam)
    lines = [f"Diagnostics that recover at least half of FedPA-LoRA's seed-0 gap to FedIT under DP: "
             f"{', '.join(found) if found else 'none (so far)'}.", ""]  # fmt: skip
    if not found or 0 not in values.get("fedit_dp", {}):
        return lines
    family = {f"{name} − {dv.comparator(name)}": (name, dv.comparator(name)) for name in found}
    title = f"The variants that close the gap against FedIT under DP (Holm over {len(family)})"
    if "fedpa_dp_refit" in found:
        title += (f"; the refit (its head refitted without DP: outside the guarantee) scored by "
                  f"{dv.refit_metric(results, point, lam)}, fixed at seed 0")
    rows = family_comparisons(values, ((title, family),))
    lines += [f"{title}: paired 95% t intervals over seeds, in accuracy points.", "", "| comparison | interval |",
              "|---|---|", *(f"| {key} | {holm_interval(rows.get(key))} |" for key in family), ""]  # fmt: skip
    return lines


def plainly_lines(results: dict) -> list[str]:
    """The finals in one sentence each, computed from the rows (paper protocol): what ε = 8 costs FedIT, and which
    method to use under DP, with how sure; nothing before both families are complete."""
    rows = comparisons(results, "val_acc")
    cost, gap = rows.get("fedit_dp − fedit"), rows.get("fedpa_dp − fedit_dp")
    if cost is None or gap is None or "holm" not in cost or "holm" not in gap:
        return []

    def points(row: dict) -> str:
        return f"{100 * row['mean']:+.1f} [{100 * row['low']:+.1f}, {100 * row['high']:+.1f}]"

    dp_cells = [f"{m}_dp" for m in dr.METHODS]
    best = max(dp_cells, key=lambda c: statistics.fmean(pr.cell_values(results, "val_acc", dv.STAGE)[c].values()))
    cost_word = "a cost these seeds cannot tell from none" if cost["holm"] == "ties" else "a cost"
    # the comparator is the no-DP arm of the DP regime (b = 256, 120 steps, the top two layers, the head frozen),
    # itself well below the main cell's FedIT: named with its mean, so that neither is read for the other
    no_dp = statistics.fmean(pr.cell_values(results, "val_acc", dv.STAGE)["fedit"].values())
    main = list(pr.cell_values(results, "val_acc", "final").get("fedit", {}).values())
    beside = f"; the main cell's FedIT, another regime, reaches {statistics.fmean(main):.4f}" if main else ""
    return ["**In one sentence each.** ε = 8 per client (Poisson, add/remove, PLD) costs FedIT "
            f"{points(cost)} points of dev accuracy against FedIT without DP in the same regime ({no_dp:.4f}"
            f"{beside}) (n={cost['seeds']}, Holm p {cost['holm_p']:.3f}), {cost_word}. Under DP the best method here is {best[: -len('_dp')]}; FedPA-LoRA "
            f"against FedIT: {points(gap)} (n={gap['seeds']}, Holm p {gap['holm_p']:.3f}, {gap['holm']}).", ""]


def dp_valid_section(results: dict, selected_main: dict | None) -> list[str]:
    """The section, as far as the committed runs go."""
    if not any(k.startswith(f"{dv.STAGE}/") for k in results):
        return []
    lines = ["## DP in a valid treatment (stage `dpvalid`)", "",
             "Declared in `research/study/sst2_dp_valid.py` before its runs: the dpregime regime with each client's "
             "head inside DP-SGD's guarantee (noised, or frozen at its initial value), ε = 8 per client (Poisson, "
             "add/remove, PLD).", "", *search_lines(results)]  # fmt: skip
    _, _, top = dv.selected(results)
    if top is None or not dv.passes_gate(results, top) or selected_main is None:
        return lines
    point, lam = dv.point_of(top), selected_main["methods"]["fedpa"]["lam"]
    lines += final_lines(results) + plainly_lines(results)
    lines += single_lines(results, dv.diagnostic_runs(point, lam), "Diagnostics (single seed, not selecting):", True)
    lines += refit_check(results, point, lam) + closing_lines(results, point, lam)
    lines += single_lines(results, dv.device_runs(selected_main, results),
                          "Part E′ (N = 2,000, K = 400, client-level DP at ε = 8, one seed):")  # fmt: skip
    return lines
