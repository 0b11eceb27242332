"""The SST-2 protocol report's ``dpregime`` section (issue 59), from the committed run files alone: the search
(held-out score, macro-F1, each stepping client's z and the signal/noise bound b/(z√D)), the selected regime, the
finals with ε in both conventions and their paired comparisons (Holm per family), the mechanism's diagnostics, and
one figure, accuracy against b with and without DP. The design is :mod:`research.study.sst2_dp_regime`'s docstring.
The stage's DP-SGD runs with a local head are withdrawn as not private (the head trained outside the mechanism), and
the section says so first."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from research.study import protocol_results as pr
from research.study import sst2_dp_device as dd
from research.study import sst2_dp_regime as dr
from research.study import sst2_protocol as sp
from research.study.report_privacy import agreement, macro_f1, paired
from research.study.report_text import pm as _pm
from research.study.report_text import score as _score

FAMILIES = (
    ("FedPA-LoRA against each other method under DP, Holm over 3",
     {f"fedpa_dp − {m}_dp": ("fedpa_dp", f"{m}_dp") for m in dr.METHODS if m != "fedpa"}),
    ("each method under DP against itself without DP, Holm over 4",
     {f"{m}_dp − {m}": (f"{m}_dp", m) for m in dr.METHODS}),
    ("the other three pairwise under DP, Holm over 3 (amendment I: added after seed 0, before seeds 1–2)",
     {f"{a}_dp − {b}_dp": (f"{a}_dp", f"{b}_dp") for i, a in enumerate(dr.OTHERS) for b in dr.OTHERS[i + 1 :]}),
)  # fmt: skip


def _o(opts) -> dict[str, str]:
    opts = list(opts)
    return dict(zip(opts[::2], opts[1::2]))


def noised_size(opts: dict[str, str]) -> int:
    """D: the entries DP-SGD clips and noises in a run of the stage (LoRA on its layers, the head when federated)."""
    from fs_fedpa.tools.dp_table import trained

    layers = opts["model.seqcls.layers_to_transform"].count(",") + 1
    return trained("fedpa / fedit / fedsa_lora", layers=layers, head=opts["personalization.local_param"] == "[]")


def clients(result: dict | None) -> list[dict]:
    """The ledger's entries of the clients that took DP steps."""
    entries = (((result or {}).get("privacy") or {}).get("dp_clients") or {}).values()
    return [v for v in entries if v and v.get("steps")]


def other_reading(result: dict | None) -> list[float]:
    """Per stepping client, the ε of the same noise in the other adjacency: a Poisson run read as replace-one with
    its own Poisson sampling (PLD), a fixed-size run read with Poisson sampling and add/remove (RDP)."""
    privacy = (result or {}).get("privacy") or {}
    try:
        from fs_fedpa.privacy.accountant import poisson_add_remove_epsilon, poisson_replace_one_epsilon
    except ImportError:
        return []
    out = []
    for v in clients(result):
        if privacy.get("dp_sampling") == "poisson":
            out.append(poisson_replace_one_epsilon(v["b"] / v["n"], v["noise_multiplier"], v["steps"], v["delta"]))
        else:
            out.append(poisson_add_remove_epsilon(v["b"] / v["n"], v["noise_multiplier"], v["steps"], v["delta"]))
    return out


def _range(values: list[float], fmt: str = ".2f") -> str:
    return "–" if not values else f"{min(values):{fmt}}–{max(values):{fmt}}"


def search_lines(results: dict, runs: list[sp.Run]) -> list[str]:
    lines = [
        "| run | b | τ | head | layers | optimizer | C | held-out score | macro-F1 | z (stepping clients) | b/(z√D) "
        "| time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        o, result = _o(run.opts), results.get(run.key)
        zs = [v["noise_multiplier"] for v in clients(result)]
        D = noised_size(o)
        bound = [int(o["dataloader.batch_size"]) / (z * math.sqrt(D)) for z in zs]
        where = "–" if result is None else f"{result['seconds']:.0f} s {'GPU' if sp.on_gpu(result) else 'CPU'}"
        optimizer = f"{o['train.optimizer.type']} {o['train.optimizer.lr']}"
        lines.append(
            f"| {run.name[len('search_'):]} | {o['dataloader.batch_size']} | {o['train.local_update_steps']} | "
            f"{'federated' if o['personalization.local_param'] == '[]' else 'local'} | "
            f"{o['model.seqcls.layers_to_transform']} | {optimizer} | {o['fedpa.dp_clip']} | "
            f"{'not run yet' if result is None else _score(sp.score(result))} | "
            f"{'–' if result is None else _score(macro_f1(result))} | {_range(zs)} | {_range(bound, '.3g')} | {where} |"
        )
    return [*lines, ""]


def diagnostic_lines(results: dict, runs: list[sp.Run]) -> list[str]:
    """Part D's diagnostics: each one's held-out score, macro-F1 and loss at the last evaluation, beside the
    search run of its regime at ε = 8."""
    if not runs:
        return []
    lines = [
        "**Diagnostics (part D, not selecting).** FedIT at the best of A and B on the held-out split: without "
        f"DP, and with DP-SGD's sampling and clip but noise z = {dr.DIAG_Z:g} (its ε is meaningless); the search run "
        "of the same regime at ε = 8 beside each.",
        "",
        "| run | DP-SGD | C | z | held-out score | macro-F1 | held-out loss, last | same regime at ε = 8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        o, result = _o(run.opts), results.get(run.key)
        dp = sp.dp_sgd(run.opts)
        twin = f"{dr.STAGE}/search_{run.name[len('diag_') :].rsplit('_', 1)[0]}_s{run.seed}"
        last = result and pr.final_metric(result, "val_avg_loss")
        lines.append(
            f"| {run.name} | {'yes' if dp else 'no'} | {o.get('fedpa.dp_clip', '–')} | "
            f"{o.get('fedpa.dp_noise_multiplier', '–')} | "
            f"{'not run yet' if result is None else _score(sp.score(result))} | "
            f"{'–' if result is None else _score(macro_f1(result))} | {'–' if last is None else f'{last:.4f}'} | "
            f"{'–' if twin not in results else _score(sp.score(results[twin]))} |"
        )
    return [*lines, ""]


def released_size(method: str) -> int:
    """D of the cross-device part: the entries a client's contribution has (LoRA on the top two layers, the head)."""
    from fs_fedpa.tools.dp_table import released

    space = {"fedpa": "fedpa", "fedit": "fedit"}.get(method, "ffa_lora / fedsvd")
    return released("MiniLM-L6 (this cell)", space, layers=len(dd.LAYERS), head=True)


def device_lines(results: dict, plain: list[sp.Run], private: list[sp.Run]) -> list[str]:
    """Part E: per method, the dev accuracy at the last round without and with client-level DP, the clip, z, the
    bound K/(z√D) and ε."""
    lines = [
        f"**Cross-device, client level (part E, `research/study/sst2_dp_device.py`).** N = {dd.CLIENTS:,} clients "
        f"(LDA α = {dd.ALPHA:g}), K = {dd.SAMPLED} a round, T = {dd.ROUNDS}, τ = {dd.LOCAL_STEPS} step of 16, LoRA on "
        f"MiniLM's top two layers, the head federated; client-level DP at ε = {dd.EPSILON:g} (replace-one, K of N "
        "without replacement), C the median contribution norm of the method's no-DP run. One seed: a measurement, "
        "not a ranking. D: the entries of a client's contribution; K/(z√D): the largest possible signal on the mean "
        "over the noise's norm. Amended on 2026-11-29 before any DP run: a method's DP run is made only if its run "
        f"without DP ended above {dd.LEARNED:.3f}, the one-label accuracy {dd.ONE_LABEL:.4f} plus two binomial "
        "standard errors on 872 sentences.",
        "",
        "| method | dev accuracy, no DP | dev accuracy, DP | C | z | D | K/(z√D) | ε | CPU time (no DP, DP) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for base in plain:
        dp = next((r for r in private if r.method == base.method), None)
        a, b = results.get(base.key), results.get(dp.key) if dp else None
        privacy = (b or {}).get("privacy") or {}
        z, D = privacy.get("dp_noise_multiplier"), released_size(base.method)
        bound = f"{dd.SAMPLED / (z * math.sqrt(D)):.3g}" if z else "–"
        eps = f"{privacy['dp_epsilon']:.2f}" if "dp_epsilon" in privacy else "–"
        times = ", ".join("–" if r is None else f"{r.get('cpu_seconds', r['seconds']) / 60:.0f} min" for r in (a, b))
        acc = [_score(v) if r and (v := pr.final_metric(r, "val_acc")) is not None else "not run yet" for r in (a, b)]
        if a is not None and dp is None and not dd.learned(a):
            acc[1] = "not made: no DP run of a method that did not learn without DP"
        lines.append(
            f"| {base.method} | {acc[0]} | {acc[1]} | {privacy.get('dp_clip', '–')} | "
            f"{f'{z:.3g}' if z else '–'} | {D:,} | {bound} | "
            f"{eps} | {times} |"
        )
    return [*lines, ""]


def final_values(results: dict) -> dict[str, dict[int, float]]:
    return pr.cell_values(results, "val_acc", dr.STAGE)


def family_comparisons(values: dict[str, dict[int, float]], families) -> dict[str, dict]:
    """Every row of ``families`` ((title, {label: (cell, cell)}) each) whose cells share 2 seeds or more in
    ``values``; Holm within a family once all its rows are in."""
    rows = {}
    for _, family in families:
        mine = {k: row for k, (a, b) in family.items() if (row := paired(values.get(a, {}), values.get(b, {})))}
        rows.update(pr.with_holm(mine) if len(mine) == len(family) else mine)
    return rows


def comparisons(results: dict) -> dict[str, dict]:
    """Every row of :data:`FAMILIES` (:func:`family_comparisons`)."""
    return family_comparisons(final_values(results), FAMILIES)


def _last_quarter(ratios: list) -> float | None:
    last = [r for r in ratios[-max(1, len(ratios) // 4) :] if r is not None]
    return statistics.median(last) if last else None


def noise_shares(run: dict) -> list[float]:
    """Each DP-SGD client's median noise/signal over the last quarter of its rounds (``noise_signal`` of the run
    file; rounds where its clipped sum was 0 left out)."""
    return [v for ratios in (run.get("noise_signal") or {}).values() if (v := _last_quarter(ratios)) is not None]


def client_lines(results: dict) -> list[str]:
    """The mechanism per client: each one's own model (``local.val_*``) on its dev shard at the last round and, under
    DP-SGD, its noise/signal (its median over the last quarter of the rounds); medians over seeds (one split)."""
    cells = [*(f"{m}_dp" for m in dr.METHODS), "fedpa", "fedit"]
    runs = {c: [r for k, r in results.items() if k.startswith(f"{dr.STAGE}/{c}_s") and r.get("clients")] for c in cells}
    ids = sorted({i for rs in runs.values() for r in rs for i in r["clients"]}, key=int)
    if not ids:
        return []
    lines = [
        "Per client, the mechanism: each client's own model on its dev shard at the last round (accuracy / macro-F1; "
        "a model that predicts one label scores a macro-F1 of 0.5 at most) and, under DP-SGD, its "
        "noise/signal (its median over the last quarter of the rounds; – where it takes no DP step: under "
        f"{dr.MIN_RECORDS:,} training sentences); medians over seeds, whose split is the same.",
        "",
        "| client | dev sentences | " + " | ".join(f"{c} (seeds)" for c in cells) + " |",
        "|---|---|" + "---|" * len(cells),
    ]

    def med(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    for i in ids:
        sizes = {r["clients"][i].get("val_total") for rs in runs.values() for r in rs if i in r["clients"]}
        row = [i, "/".join(str(n) for n in sorted(n for n in sizes if n is not None)) or "–"]
        for cell in cells:
            mine = [r for r in runs[cell] if i in r["clients"]]
            acc = med([r["clients"][i].get("local.val_acc") for r in mine])
            f1 = med([r["clients"][i].get("local.val_f1") for r in mine])
            share = med([_last_quarter((r.get("noise_signal") or {}).get(i) or []) for r in mine])
            text = "–" if acc is None else f"{acc:.3f} / {f1:.2f}" if f1 is not None else f"{acc:.3f}"
            if cell.endswith("_dp") and mine:
                text = f"{'–' if share is None else f'{share:.3g}'}; {text}"
            row.append(f"{text} ({len(mine)})" if mine else "–")
        lines.append("| " + " | ".join(row) + " |")
    return [*lines, ""]


def final_lines(results: dict) -> list[str]:
    values = final_values(results)
    cells = [*(c for m in dr.METHODS for c in (f"{m}_dp", m)), "fedit_dp_replace", "central_dp", "central_dp_replace",
             "central"]  # fmt: skip
    lines = [
        "Finals (withdrawn: not private; the DP cells' local heads trained plainly): the dev set, accuracy at the "
        "last round (mean ± sample sd over seeds (n)). ε: what the run's ledger states (largest client and seed), "
        "no guarantee for these runs, and the same noise read in the other convention (median [range] over stepping "
        "clients and seeds; for comparison with published numbers only; a Poisson run read as replace-one, still "
        "Poisson, by PLD, a fixed-size run read as add/remove by RDP, where an independent audit found PLD lower: about 1.47 for "
        "fedit_dp_replace and 0.69 for central_dp_replace). Noise/signal: "
        "‖noise‖ / ‖clipped sum‖ of a DP-SGD step, each client's median over the last quarter of the rounds, from "
        "its own log (median [range] over clients and seeds).",
        "",
        "| cell | dev accuracy | ε (own) | ε, other convention | noise/signal per step | agreement | "
        "global norm, last round |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        runs = [r for k, r in results.items() if k.startswith(f"{dr.STAGE}/{cell}_s")]
        eps = [r["privacy"]["dp_epsilon"] for r in runs if r.get("privacy")]
        other = sorted(e for r in runs for e in other_reading(r))
        read = f"{statistics.median(other):.2f} [{other[0]:.2f}, {other[-1]:.2f}]" if other else "–"
        shares = sorted(v for r in runs for v in noise_shares(r))
        share = f"{statistics.median(shares):.3g} [{shares[0]:.3g}, {shares[-1]:.3g}]" if shares else "–"
        agree = [a for r in runs if (a := agreement(r)) is not None]
        norms = [r["diagnostics"][-1]["global_norm"] for r in runs if r.get("diagnostics")]
        lines.append(
            f"| {cell} | {_pm(list(values.get(cell, {}).values()))} | {f'{max(eps):.2f}' if eps else '–'} | {read} | "
            f"{share} | {_pm(agree)} | {_pm(norms)} |"
        )
    rows = comparisons(results)
    for title, family in FAMILIES:
        lines += ["", f"Paired 95% t intervals over seeds (accuracy), {title}.", "", "| comparison | interval |",
                  "|---|---|"]  # fmt: skip
        for key in family:
            row = rows.get(key)
            text = "–" if row is None else (
                f"{row['mean']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}]; n={row['seeds']}, ahead in {row['ahead']}"
                + (f"; Holm p {row['holm_p']:.3f}, {row['holm']}" if "holm" in row else ""))  # fmt: skip
            lines.append(f"| {key} | {text} |")
    return [*lines, "", *client_lines(results)]


def figure(results: dict, report: Path) -> list[str]:
    """Two panels. The search: each run's held-out score under DP at ε = 8 against its learning rate (colour: b,
    marker: the head; the selected run ringed). The finals: each method's dev accuracy at ε = 8 in both conventions
    (where run) and without DP (mean and sample sd over seeds), and the central anchors."""
    search = [r for k, r in results.items() if k.startswith(f"{dr.STAGE}/search_")]
    if not search:
        return []
    from research.harness.plots import pyplot, save

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 1.3]})
    for b, colour in zip(dr.BATCHES, ("tab:blue", "tab:orange")):
        for head, marker in (("local", "o"), ("federated", "s")):
            for sgd in (False, True):
                points = [(float(o["train.optimizer.lr"]), sp.score(r)) for r in search
                          if int((o := _o(r["opts"]))["dataloader.batch_size"]) == b
                          and (o["personalization.local_param"] == "[]") == (head == "federated")
                          and (o["train.optimizer.type"] == "SGD") == sgd]  # fmt: skip
                if points:
                    xs, ys = zip(*points)
                    left.scatter(xs, ys, marker="x" if sgd else marker, color=colour, alpha=0.7,
                                 label=f"b = {b}, {head} head" + (", SGD + momentum" if sgd else ""))  # fmt: skip
    top = dr.search(results).top
    if top is not None and top.key in results:
        chosen = results[top.key]
        left.scatter([float(_o(chosen["opts"])["train.optimizer.lr"])], [sp.score(chosen)], s=220,
                     facecolors="none", edgecolors="black", label="selected")  # fmt: skip
    left.set_xscale("log")
    left.set_xlabel("learning rate")
    left.set_ylabel("held-out score (mean of the last two evaluations)")
    left.set_title(f"search: FedIT, DP-SGD at a stated ε = {dr.EPSILON:g}, seed 0", fontsize=10)
    left.legend(fontsize=7, loc="center left")
    values = final_values(results)
    names = [*dr.METHODS, "central"]
    series = ((-0.18, "_dp", f"stated ε = {dr.EPSILON:g} (Poisson, add/remove), not private", "v", "tab:red"),
              (0.0, "_dp_replace", f"stated ε = {dr.EPSILON:g} (fixed-size, replace-one), not private", "D",
               "tab:purple"),
              (0.18, "", "no DP", "^", "tab:green"))  # fmt: skip
    for offset, suffix, label, marker, colour in series:
        labelled = False
        for i, name in enumerate(names):
            seeds = list(values.get(f"{name}{suffix}", {}).values())
            if seeds:
                sd = statistics.stdev(seeds) if len(seeds) > 1 else 0.0
                right.errorbar([i + offset], [statistics.fmean(seeds)], yerr=[sd], fmt=marker, capsize=3,
                               color=colour, label=None if labelled else label)  # fmt: skip
                labelled = True
    right.set_xticks(range(len(names)), [n.replace("_", " ") for n in names])
    right.set_xlim(-0.6, len(names) - 0.4)
    right.set_ylabel("dev accuracy, last round")
    right.set_title("finals in the selected regime (mean ± sd over seeds; central: one seed)", fontsize=10)
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=7)
    else:
        right.text(0.5, 0.5, "no final run yet", ha="center", va="center", transform=right.transAxes)
    fig.suptitle(f"SST-2, MiniLM, sample-level DP-SGD, {dr.STEPS} steps a client\nwithdrawn: not private (the local "
                 "heads trained outside the mechanism, so the stated ε = 8 is no guarantee)", fontsize=10)
    folder = report / dr.STAGE
    folder.mkdir(parents=True, exist_ok=True)
    path = save(fig, folder / "dp_regime.png")
    return [f"![the search and the finals, withdrawn: not private]({dr.STAGE}/{path.name})", ""]


def dp_regime_section(results: dict, stages: list[tuple[str, list[sp.Run]]], report: Path) -> list[str]:
    parts = dict(stages)
    a = parts.get("dp regime: search A (b, tau, head)", [])
    lines = ["## Where DP-SGD learns: the dpregime stage (issue 59), withdrawn: not private", ""]
    if not a:
        return [*lines, "Not planned.", ""]
    lines += [
        "**Withdrawn: not private.** Every DP-SGD run of this stage with a local head (the DP finals, the central DP "
        "anchors, the DP diagnostic and the local-head search runs) trained that head plainly, on the batch's exact "
        "gradient outside the mechanism; through the head one record moves every other record's clipped gradient, "
        "so the ε = 8 stated for them is no guarantee. They are withdrawn as privacy results and kept here only as a "
        "record of a non-private regime: they say neither what ε = 8 buys nor which method to use under DP. Not "
        "affected: the search runs with a federated head and part E's client-level run. A re-measurement in a valid "
        "treatment (stage `dpvalid`, the head noised or frozen) is pending.",
        "",
        f"Declared before its runs in `research/study/sst2_dp_regime.py`: sample-level DP-SGD at ε = {dr.EPSILON:g} "
        f"(Poisson sampling, add/remove adjacency, PLD; δ = min(1e-5, 1/(10 n_i)); C = {dr.CLIP:g} in parts A and B), "
        f"{dr.STEPS} noisy steps a client, clients under {dr.MIN_RECORDS:,} sentences taking none; FedIT searched on "
        "the held-out split (score: the mean of the last two of four evaluations), then the finals on the dev set. "
        "D: the entries clipped and noised (a local head trained plainly, outside the mechanism, and is not in D); "
        "b/(z√D): the largest "
        "possible signal, b·C, over the noise's norm.",
        "",
        "Part C (C ∈ {" + ", ".join(f"{c:g}" for c in dr.CLIPS) + "} × b ∈ {256, 1,024} at the best of A and B; "
        "b = 1,024 dropped by G below) "
        "was added on 2026-11-28, before its runs, and B's four top-layer runs dropped: every A and B run ends at "
        "the shard-majority score, and the measured signal is one reason (`research/scripts/dp_signal_noise.py`, "
        "one client of "
        "the training split, n = 8,000, b = 256, z = 0.62): with the head local a record's LoRA gradient is shorter "
        "than 0.1, far inside C = 1 (a step's clipped sum is the same at C = 0.1), so that sum is about 1.2 "
        "against noise of norm 68, 55 times it; 5 times at C = 0.1 and 2.5 times at C = 0.01, where every record is "
        "clipped. With the head federated every "
        "record is clipped at any C ≤ 1 (noise/signal 2.1), so C does not change that run under Adam.",
        "",
        "Part D (diagnostics, not selecting) and part F (AdamW at "
        + " and ".join(f"{lr:g}" for lr in dr.F_LRS) + f" under DP at C = {dr.F_CLIP:g}, and without DP at "
        f"{dr.F_LRS[0]:g}) were added on 2026-11-28, each before its runs: C's first two runs ended at the majority "
        "score too, though their clients logged noise at 0.3–1.4 times the clipped sum, and D's run without DP was "
        "still at the majority score at round 60 of 120, so AdamW 5e-4 is too slow for this regime even without noise.",
        "",
        "Amendment G (2026-11-29, before their runs) dropped three runs unrun, about 6 CPU-h here: C's two at "
        "b = 1,024, still at AdamW 5e-4, the rate at which D's run without any noise stayed at the majority score for "
        "90 of 120 steps (under Adam four times the records do not make a step longer); D's at C = 0.01, whose "
        "question F answered (the rate stopped learning); and F's without DP, which the finals' FedIT without DP "
        "measures in the same regime on the dev set over three seeds. The regime is the best of the runs made.",
        "",
        *figure(results, report),
        "**Search.**",
        "",
        *search_lines(results, [*a, *parts.get("dp regime: search B (optimizer, layers)", []),
                                *parts.get("dp regime: search C (clip, b)", []),
                                *parts.get("dp regime: search F (learning rate)", [])]),
        *diagnostic_lines(results, parts.get("dp regime: diagnostics D (not selecting)", [])),
    ]
    device = device_lines(results, parts.get("dp regime: cross-device, no DP", []),
                          parts.get("dp regime: cross-device, DP", []))  # fmt: skip
    regime = dr.selected_regime(results)
    if regime is None:
        return [*lines, "The regime is selected once the search's runs are in.", "", *device]
    lines += [f"Selected regime (best held-out score, the first of ties): `{regime.name}`.", ""]
    return [*lines, *final_lines(results), *device]
