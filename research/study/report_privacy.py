"""The SST-2 protocol report's privacy section (issue 43), from the committed run files alone.

(a) Sample-level DP-SGD in the main cell: the tuning table (method × clip C × rate, held-out score, ε spent), the
selection, and the final runs: each cell's accuracy and ε, each DP method against FedIT under DP (paired by seed,
Holm over the three, per protocol) and each against itself without DP (a second table, Holm over its four). (b)
Client-level DP in the partial setting: each method without and with DP on one seed, its clip and the noise per
entry. The design is fixed in :mod:`research.study.sst2_protocol` above
:func:`~research.study.sst2_privacy.privacy_runs`.
"""

from __future__ import annotations

import statistics

from fs_fedpa import privacy
from research.study import protocol_results as pr
from research.study import sst2_privacy as spriv
from research.study import sst2_protocol as sp
from research.study import stats
from research.study.report_text import pm as _pm
from research.study.report_text import score as _score

METRICS = {"val_acc": "paper protocol", "local.val_acc": "own factors"}
DP_CELLS = tuple(f"{m}_dp" for m in spriv.PRIVACY_METHODS)
# each DP cell's counterpart without DP, (stage, cell): the final stage's runs, FedSVD's own (it has no final runs)
NO_DP = {"fedpa_dp": ("final", "fedpa"), "fedit_dp": ("final", "fedit"), "ffa_lora_dp": ("final", "ffa_lora"),
         "fedsvd_dp": ("privacy", "fedsvd")}  # fmt: skip
# the report's comparison tables, each one Holm family (docs/compare.md's rule): (title, the rows' keys)
FAMILIES = (
    (
        "against FedIT under DP, Holm over its three rows",
        tuple(f"{c} − fedit_dp" for c in DP_CELLS if c != "fedit_dp"),
    ),
    ("against the same method without DP, Holm over its four rows", tuple(f"{c} − no DP" for c in DP_CELLS)),
)


def _opts(run: sp.Run) -> dict[str, str]:
    return dict(zip(run.opts[::2], run.opts[1::2]))


def spent(result: dict | None) -> float | None:
    """The ε a run spent by its last round at its δ (the largest client's in sample mode), from its ledger."""
    privacy = (result or {}).get("privacy")
    return None if privacy is None else privacy.get("dp_epsilon")


def literature_epsilons(result: dict | None) -> list[float]:
    """Per client of a sample-level run, the epsilon its noise spends read in the literature's convention (Poisson
    sampling at rate b/n_i, add/remove adjacency; :func:`fs_fedpa.privacy.accountant.poisson_add_remove_epsilon`), from
    the ledger's z, n, b, steps and delta. Empty for a run without per-client entries (or without dp-accounting)."""
    clients = ((result or {}).get("privacy") or {}).get("dp_clients") or {}
    try:
        from fs_fedpa.privacy.accountant import poisson_add_remove_epsilon

        return [poisson_add_remove_epsilon(v["b"] / v["n"], v["noise_multiplier"], v["steps"], v["delta"])
                for v in clients.values() if v]  # fmt: skip
    except ImportError:
        return []


def macro_f1(result: dict | None) -> float | None:
    """The held-out macro-F1 scored as :func:`~research.study.sst2_protocol.score` scores accuracy: the mean of the last
    two evaluations. A model that predicts one class for every sentence has 0.43 on the held-out split."""
    f1 = [m["val_f1"] for _, m in sorted((result or {}).get("rounds", {}).items()) if m.get("val_f1") is not None]
    return sum(f1[-2:]) / len(f1[-2:]) if f1 else None


def agreement(result: dict | None) -> float | None:
    """Median over rounds of ``||sum_i w_i dW_i|| / mean_i ||dW_i||`` from a run's diagnostics (``global_update_norm``
    over ``delta_norm_mean``): 1 when the clients' updates are identical, 1/sqrt(N) for N mutually orthogonal ones
    of equal norm and equal weight. For FedPA-LoRA dW_i is the client's own product s_i B_i A_i."""
    values = [d["global_update_norm"] / d["delta_norm_mean"] for d in (result or {}).get("diagnostics", [])
              if d.get("delta_norm_mean") and d.get("global_update_norm") is not None]  # fmt: skip
    return statistics.median(values) if values else None


def paired(a: dict[int, float], b: dict[int, float]) -> dict | None:
    """``{"mean", "low", "high", "p", "seeds", "ahead"}`` of a − b over their common seeds (None below 2)."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    d = [a[s] - b[s] for s in seeds]
    mean, low, high = stats.paired_interval(d)
    return {"mean": mean, "low": low, "high": high, "p": stats.paired_t_p(d), "seeds": len(seeds),
            "ahead": sum(x > 0 for x in d), "identical": all(x == 0 for x in d)}  # fmt: skip


def final_comparisons(results: dict) -> dict[str, dict[str, dict]]:
    """Per protocol: ``"<cell> − fedit_dp"`` for the three other DP cells and ``"<cell> − no DP"`` for all four,
    each with ``holm_p`` and ``holm``, its Holm-adjusted p and label over its family of :data:`FAMILIES`
    (:func:`research.study.protocol_results.with_holm`), once the whole family is in."""
    out: dict[str, dict[str, dict]] = {}
    for metric in METRICS:
        rows: dict[str, dict] = {}
        cells = {stage: pr.cell_values(results, metric, stage) for stage in ("privacy", "final")}
        fedit = cells["privacy"].get("fedit_dp", {})
        for cell in DP_CELLS:
            ours = cells["privacy"].get(cell, {})
            if cell != "fedit_dp" and (row := paired(ours, fedit)) is not None:
                rows[f"{cell} − fedit_dp"] = row
            stage, plain = NO_DP[cell]
            if (row := paired(ours, cells[stage].get(plain, {}))) is not None:
                rows[f"{cell} − no DP"] = row
        for _, keys in FAMILIES:  # adjusted once every row of the family is in
            if all(key in rows for key in keys):
                rows.update(pr.with_holm({key: rows[key] for key in keys}))
        out[metric] = rows
    return out


def _interval(row: dict | None) -> str:
    if row is None:
        return "–"
    text = (f"{row['mean']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}] {stats.verdict(row['low'], row['high'])}"
            f"; n={row['seeds']}, ahead in {row['ahead']}")  # fmt: skip
    return text + (f"; Holm p {row['holm_p']:.3f}, {row['holm']}" if "holm" in row else "")


def privacy_section(results: dict, stages: list[tuple[str, list[sp.Run]]]) -> list[str]:
    parts = dict(stages)
    tune = parts.get("privacy: sample-level tuning", [])
    lines = ["## What privacy costs", ""]
    if not tune:
        return [*lines, "Not planned.", ""]
    done = [r for r in tune if r.key in results]
    lines += [
        f"**(a) Sample-level DP-SGD, the main cell.** Each client trains by DP-SGD at ε = {spriv.PRIVACY_EPSILON:g} "
        "over the whole run (δ by the default rule, the noise calibrated for T rounds also in tuning, "
        "`fedpa.dp_horizon`); ε spent below is the ledger's (`fedpa_privacy.jsonl`) at the run's last round, the "
        "largest over the clients. Tuning: seed 0, ceil(T/2) rounds, scored on the held-out split (mean of the "
        f"last two evaluations); {len(done)} of its {len(tune)} runs are in.",
        "",
        "| method | clip C | rate | held-out score | held-out macro-F1 | ε spent |",
        "|---|---|---|---|---|---|",
    ]
    for run in tune:
        opts, result = _opts(run), results.get(run.key)
        value = None if result is None else sp.score(result)
        eps = spent(result)
        lines.append(
            f"| {run.method}{'' if privacy.entry(opts.get('fedpa.dp_mode', 'none')).noised else ' (no DP)'} | "
            f"{opts.get('fedpa.dp_clip', '–')} | "
            f"{opts.get('train.optimizer.type')} {opts.get('train.optimizer.lr')} | "
            f"{'not run yet' if result is None else _score(value)} | "
            f"{'–' if result is None else _score(macro_f1(result))} | {'–' if eps is None else f'{eps:.2f}'} |"
        )
    lines += ["", *_agreement_lines(results, tune), ""]
    choice = spriv.privacy_selection(results, tune)
    if not choice:
        lines += ["Each cell's selection and final runs follow when all of its tuning runs are in.", ""]
    else:
        waiting = sorted({spriv.privacy_cell(r) for r in tune} - set(choice))
        lines += [
            "Selected (best held-out score): "
            + "; ".join(f"{cell}: {_describe(c['opts'])} ({c['score']:.4f})" for cell, c in sorted(choice.items()))
            + "."
            + (f" Not yet selected (a tuning run missing): {', '.join(waiting)}." if waiting else ""),
            "",
        ]
        lines += _final_lines(results)
    return lines + _client_level_lines(results, parts)


def _agreement_lines(results: dict, tune: list[sp.Run]) -> list[str]:
    """FedPA-LoRA's clients' products under DP-SGD against its tune-stage runs without DP (same rate and lambda)."""
    rows = []
    for run in tune:
        if run.method != "fedpa" or (dp := agreement(results.get(run.key))) is None:
            continue
        opts = _opts(run)
        optimizer, lr = opts["train.optimizer.type"], opts["train.optimizer.lr"]
        # the tune stage's run at this rate and lambda (its rounds do not enter the key)
        plain = agreement(results.get(sp.tune_run("fedpa", optimizer, float(lr), float(opts["fedpa.lam"]), 0).key))
        rows.append(f"C {opts.get('fedpa.dp_clip')}, {optimizer} {lr}: {dp:.3f} "
                    f"(no DP: {'not run' if plain is None else f'{plain:.3f}'})")  # fmt: skip
    if not rows:
        return []
    return [
        "What DP-SGD leaves of FedPA-LoRA's shared direction: each client keeps its own factors, so "
        "‖Σ_i w_i ΔW_i‖ / mean_i ‖ΔW_i‖ over its products ΔW_i = s_i B_i A_i (median over rounds, from the run's "
        "diagnostics) is 1 when the clients agree and 1/√N = 0.316 for ten mutually orthogonal updates of equal "
        "norm (the server weighs them alike: each trains the same number of sentences a round). Under DP-SGD, per "
        "cell, beside the tune stage's run at the same rate and λ without DP: " + "; ".join(rows) + ".",
    ]


def _describe(opts: list[str]) -> str:
    o = dict(zip(opts[::2], opts[1::2]))
    text = f"{o.get('train.optimizer.type')} {o.get('train.optimizer.lr')}"
    return text + (f", C {o['fedpa.dp_clip']}" if "fedpa.dp_clip" in o else "")


def _final_lines(results: dict) -> list[str]:
    cells = [*DP_CELLS, "fedsvd"]
    lines = [
        "Final runs: T rounds, the dev set, final-round accuracy (mean ± sample sd over seeds (n)). ε spent: the "
        "run's own guarantee (fixed-size sampling without replacement, replace-one adjacency, RDP), the largest over "
        "clients and seeds. The same noise read in the convention of Opacus and the DP fine-tuning papers (Poisson "
        "sampling at rate b/n_i, add/remove adjacency): median [smallest, largest] over clients and seeds; a different "
        "guarantee, given only to compare with published numbers.",
        "",
        "| cell | paper protocol | own factors | ε spent (largest over seeds) | ε, literature's reading |",
        "|---|---|---|---|---|",
    ]
    values = {m: pr.cell_values(results, m, "privacy") for m in METRICS}
    for cell in cells:
        eps = [e for s in sp.SEEDS if (e := spent(results.get(f"privacy/{cell}_s{s}"))) is not None]
        read = sorted(e for s in sp.SEEDS for e in literature_epsilons(results.get(f"privacy/{cell}_s{s}")))
        other = f"{statistics.median(read):.2f} [{read[0]:.2f}, {read[-1]:.2f}]" if read else "–"
        lines.append(
            f"| {cell} | {_pm(list(values['val_acc'].get(cell, {}).values()))} | "
            f"{_pm(list(values['local.val_acc'].get(cell, {}).values()))} | {f'{max(eps):.2f}' if eps else '–'} | "
            f"{other} |"
        )
    comparisons = final_comparisons(results)
    for title, keys in FAMILIES:
        lines += ["", f"Paired 95% t intervals over seeds (accuracy, not points), {title}, per protocol.", "",
                  "| comparison | paper protocol | own factors |", "|---|---|---|"]  # fmt: skip
        for key in keys:
            lines.append(
                f"| {key} | {_interval(comparisons['val_acc'].get(key))} | "
                f"{_interval(comparisons['local.val_acc'].get(key))} |"
            )
        same = [k for k in keys if all(comparisons[m].get(k, {}).get("identical") for m in METRICS)]
        if same:
            lines += ["", f"{', '.join(same)}: the two cells end at exactly the same accuracy in every seed under both "
                      "protocols (a zero difference in every pair, hence Holm p 1). Such a tie says that their runs "
                      "ended alike, as runs that all fail the same way do, not that the methods are equivalent "
                      "under DP."]  # fmt: skip
    return [*lines, ""]


def _client_level_lines(results: dict, parts: dict) -> list[str]:
    plain = parts.get("privacy: client level, no DP", [])
    lines = [
        f"**(b) Client-level DP, the partial setting** (N = {sp.PARTIAL_CLIENTS}, K = {sp.PARTIAL_SAMPLED}, "
        f"{spriv.CLIENT_DP_ROUNDS} rounds, seed {spriv.CLIENT_DP_SEED}): each method without DP, then with DP at "
        f"ε = {spriv.PRIVACY_EPSILON:g}, C the median contribution norm of its no-DP run; one seed each: a "
        "measurement, "
        "not a test.",
        "",
        "| method | no DP | DP | DP − no DP | C | noise sd per entry (zC/K) | ε spent |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in plain:
        base, dp = results.get(run.key), results.get(run.key.replace(f"_s{run.seed}", f"_dp_s{run.seed}"))
        a = None if base is None else pr.final_metric(base, "val_acc")
        b = None if dp is None else pr.final_metric(dp, "val_acc")
        privacy = (dp or {}).get("privacy", {})
        diff = f"{b - a:+.4f}" if a is not None and b is not None else "–"
        lines.append(
            f"| {run.method} | {_score(a)} | {_score(b)} | {diff} | {_g(privacy.get('dp_clip'))} | "
            f"{_g(privacy.get('dp_noise_std'))} | {_g(privacy.get('dp_epsilon'))} |"
        )
    return [*lines, ""]


def _g(value) -> str:
    return "–" if value is None else f"{value:.4g}"
