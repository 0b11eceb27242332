"""The report's section on the ``dpfedpa`` stage (:mod:`research.study.sst2_dp_fedpa`): step 1's separation of the clip
from the noise and the refit control on the base model, step 2's variants on the held-out split and the gate, the
selected variant's finals against FedIT under DP and FedPA-LoRA without DP (Holm over two), and the stage's findings in
one sentence each. No torch, no FS."""

from __future__ import annotations

import statistics

from research.study import protocol_results as pr
from research.study import sst2_dp_fedpa as df
from research.study import sst2_dp_valid as dv
from research.study import sst2_protocol as sp
from research.study.report_dp_regime import family_comparisons, noise_shares
from research.study.report_dp_valid import holm_interval
from research.study.report_text import METRIC_NAMES, METRICS

LOCKED_TOL = 1.5e-4  # a client's accuracies are stored to 4 decimals
REFIT = ("refit.val_acc", "local.refit.val_acc")


def majority_shares(results: dict) -> dict[str, float]:
    """client -> its dev shard's majority share, for the clients that take DP steps, read from ``dpvalid/fedpa_dp``
    seed 0 (its global adapter predicts one label everywhere, so a client's global accuracy a is one label's share
    and max(a, 1 − a) the majority's); {} until that run is in."""
    run = results.get(f"{dv.STAGE}/fedpa_dp_s0")
    if not run or not run.get("clients"):
        return {}
    stepping = {c for c, e in ((run.get("privacy") or {}).get("dp_clients") or {}).items() if e.get("steps")}
    return {c: max(m["val_acc"], 1 - m["val_acc"]) for c, m in run["clients"].items()
            if c in stepping and m.get("val_acc") is not None}  # fmt: skip


def prior_locked(run: dict | None, shares: dict[str, float]) -> tuple[int, int] | None:
    """(how many stepping clients' own model scores exactly its shard's majority share, how many were read); None
    without the run's per-client scores."""
    if not run or not run.get("clients") or not shares:
        return None
    own = {c: m.get("local.val_acc") for c, m in run["clients"].items()}
    read = [c for c in shares if own.get(c) is not None]
    return sum(abs(own[c] - shares[c]) <= LOCKED_TOL for c in read), len(read)


def _acc(run: dict | None, metric: str) -> str:
    value = pr.final_metric(run, metric) if run else None
    return "–" if value is None else f"{value:.4f}"


def step_1_rows(results: dict) -> list[tuple[str, str, str, dict | None]]:
    """(cell, clip, noise, run) of step 1's 2 x 2, the committed DP run first."""
    runs = {r.name: results.get(r.key) for r in df.step_1(0.0)}
    return [("fedpa_dp (dpvalid, seed 0)", "C = 0.01", "ε = 8", results.get(f"{dv.STAGE}/fedpa_dp_s0")),
            ("sep_clip", "C = 0.01", "none", runs["sep_clip"]),
            ("sep_noise", "none", f"z = {df.MEDIAN_Z:g} at C = 0.01's scale", runs["sep_noise"]),
            ("sep_neither", "none", "none", runs["sep_neither"])]  # fmt: skip


def step_1_lines(results: dict) -> list[str]:
    shares = majority_shares(results)
    lines = ["Step 1, the clip and the noise apart (FedPA-LoRA, seed 0, dev set; declared diagnostics, not "
             "selecting). *Locked*: stepping clients whose own model scores exactly its shard's majority share.", "",
             "| run | clip | noise | paper protocol | own factors | locked | noise/signal (median client, last "
             "quarter) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for cell, clip, noise, run in step_1_rows(results):
        locked = prior_locked(run, shares)
        ratio = noise_shares(run) if run else []
        lines.append(f"| {cell} | {clip} | {noise} | {_acc(run, 'val_acc')} | {_acc(run, 'local.val_acc')} | "
                     f"{'–' if locked is None else f'{locked[0]}/{locked[1]}'} | "
                     f"{f'{statistics.median(ratio):.3g}' if ratio else '–'} |")  # fmt: skip
    base = results.get(next(r.key for r in df.step_1(0.0) if r.name == "base_refit"))
    lines += ["", "The refit control (each client's head refitted on its training shard without DP, outside any "
              "guarantee; the adapter at seed 0 against no adapter at all):", "",
              "| run | paper protocol, head refitted | own factors, head refitted |", "|---|---|---|"]  # fmt: skip
    for cell, run in (("base_refit (MiniLM, no adapter)", base),
                      ("fedpa_dp_refit (dpvalid)", results.get(f"{dv.STAGE}/fedpa_dp_refit_s0")),
                      ("fedit_dp_refit (dpvalid)", results.get(f"{dv.STAGE}/fedit_dp_refit_s0"))):  # fmt: skip
        lines.append(f"| {cell} | {_acc(run, REFIT[0])} | {_acc(run, REFIT[1])} |")
    return [*lines, ""]


def step_2_lines(results: dict, lam: float) -> list[str]:
    lines = ["Step 2, the variants under DP (seed 0, the held-out split; score: the mean of the last two "
             "evaluations):", "", "| variant | held-out accuracy by evaluation | score |",
             "|---|---|---|"]  # fmt: skip
    for run in df.variants(lam):
        result = results.get(run.key)
        if result is None:
            lines.append(f"| {run.name} | not run yet | – |")
            continue
        accs = ", ".join(f"{m['val_acc']:.4f}" for _, m in sorted(result["rounds"].items(), key=lambda kv: int(kv[0]))
                         if "val_acc" in m)  # fmt: skip
        lines.append(f"| {run.name} | {accs} | {sp.score(result):.4f} |")
    top = df.selected(results, lam)
    if top is not None:
        verdict = "passes" if df.passes_gate(results, lam) else "does not pass"
        lines += ["", f"The best, {top.name} ({sp.score(results[top.key]):.4f}), {verdict} the declared gate "
                  f"({dv.GATE:.4f}; a client predicting its shard's majority label scores 0.7406 on this split). Its "
                  "finals run either way (the stage's amendment).", ""]  # fmt: skip
    return [*lines, ""]


def final_values(results: dict, lam: float, metric: str) -> tuple[str, dict[str, dict[int, float]]]:
    """(the selected variant's cell, cell -> seed -> ``metric``) for the variant under DP and its two comparators."""
    top = df.selected(results, lam)
    cell = df.final_runs(top)[0].name if top is not None else ""
    mine = pr.cell_values(results, metric, df.STAGE).get(cell, {})
    theirs = pr.cell_values(results, metric, dv.STAGE)
    return cell, {cell: mine, "fedit_dp": theirs.get("fedit_dp", {}), "fedpa_nodp": theirs.get("fedpa", {})}


def family(cell: str) -> dict[str, tuple[str, str]]:
    return {f"{cell} − {other}": (cell, other) for other, _ in df.FINAL_FAMILY}


def final_rows(results: dict, lam: float) -> tuple[str, dict[str, dict]]:
    cell, values = final_values(results, lam, "val_acc")
    return cell, family_comparisons(values, (("finals", family(cell)),))


def final_lines(results: dict, lam: float) -> list[str]:
    cell, rows = final_rows(results, lam)
    lines = [f"Finals of {cell} (dev set, last round; `fedpa_nodp` is dpvalid's FedPA-LoRA without DP in the frozen "
             "head's treatment). Paired 95% t intervals over seeds, in accuracy points, Holm over the two:", "",
             "| comparison | paper protocol (the endpoint) |", "|---|---|",
             *(f"| {key} | {holm_interval(rows.get(key))} |" for key in family(cell))]  # fmt: skip
    shares = majority_shares(results)
    locked = [prior_locked(results.get(r.key), shares) for r in df.final_runs(df.selected(results, lam))]
    shown = ", ".join("–" if x is None else f"{x[0]}/{x[1]}" for x in locked)
    lines.append(f"\nStepping clients whose own model scores exactly its shard's majority share, seeds 0-2: {shown}.")
    for metric in METRICS:
        _, values = final_values(results, lam, metric)
        means = ", ".join(f"{c} {statistics.fmean(v.values()):.4f} (n={len(v)})" for c, v in values.items() if v)
        lines.append(f"\nMeans, {METRIC_NAMES[metric]}: {means}.")
    return [*lines, ""]


def _points(row: dict) -> str:
    return f"{100 * row['mean']:+.1f} [{100 * row['low']:+.1f}, {100 * row['high']:+.1f}]".replace("-", "−")


def plainly_lines(results: dict, lam: float) -> list[str]:
    """What ε = 8 costs FedPA-LoRA (dpvalid's fedpa_dp − fedpa), and the selected variant against FedIT under DP
    with its gate's verdict; nothing before the variants are all in."""
    top = df.selected(results, lam)
    if top is None:
        return []
    cells = pr.cell_values(results, "val_acc", dv.STAGE)
    cost = pr.paired_rows(results, "val_acc", dv.STAGE, "fedpa_dp", {c: v for c, v in cells.items()
                                                                      if c in ("fedpa_dp", "fedpa")}).get("fedpa")
    said = (f"ε = 8 costs FedPA-LoRA {_points(cost)} points of dev accuracy (n={cost['seeds']}) against itself "
            "without DP. ") if cost else ""
    gate = "passes" if df.passes_gate(results, lam) else "does not pass"
    cell, rows = final_rows(results, lam)
    against = rows.get(f"{cell} − fedit_dp")
    if against is None or "holm" not in against:
        return [f"**In one sentence each.** {said}The best variant on the held-out split, {top.name} "
                f"({sp.score(results[top.key]):.4f}), {gate} the gate ({dv.GATE:.4f}); its finals are not all in.", ""]
    return [f"**In one sentence each.** {said}The best variant on the held-out split, {top.name}, {gate} the gate "
            f"({sp.score(results[top.key]):.4f} against {dv.GATE:.4f}); against FedIT under DP it scores "
            f"{_points(against)} points (n={against['seeds']}, Holm p {against['holm_p']:.3f}, {against['holm']}).",
            ""]


def dp_fedpa_section(results: dict, selected_main: dict | None) -> list[str]:
    """The section, as far as the committed runs go."""
    if not any(k.startswith(f"{df.STAGE}/") for k in results) or selected_main is None:
        return []
    lam = selected_main["methods"]["fedpa"]["lam"]
    lines = ["## FedPA-LoRA under DP: causes and variants (stage `dpfedpa`)", "",
             "Declared in `research/study/sst2_dp_fedpa.py` before its runs, at the dpvalid stage's point (the head "
             "frozen, C = 0.01, AdamW 1e-2, ε = 8 per client: Poisson, add/remove, PLD).", "",
             *step_1_lines(results), *step_2_lines(results, lam)]  # fmt: skip
    if df.selected(results, lam) is not None:
        lines += final_lines(results, lam)
    return [*lines, *plainly_lines(results, lam)]
