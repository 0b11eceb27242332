"""The SST-2 protocol's ``privacy`` stage as data (declared before its runs; docs/study/sst2_protocol.md): what
differential privacy costs, at sample level in the main cell and at client level in the partial setting. Built on
:mod:`research.study.sst2_protocol`'s runs and selection; the runner (:mod:`research.study.sst2_compare`) appends
:func:`privacy_runs` to the protocol's plan. No torch, no FS."""

from __future__ import annotations

import math
import statistics

from research.study.sst2_protocol import (
    FINAL_EVAL,
    LR_GRID,
    ONE_THREAD,
    PARTIAL_CLIENTS,
    PARTIAL_EVERY,
    PARTIAL_SAMPLED,
    SEEDS,
    TUNE_EVAL,
    Run,
    hparams,
    score,
    selected_opts,
    tune_name,
)

# Issue 43, fixed before its runs: what privacy costs.
# (a) Sample level, the main cell (N = 10, T rounds): PRIVACY_METHODS under DP-SGD at epsilon PRIVACY_EPSILON per
#     client; delta by the default rule min(1e-5, 1/(10 n_i)) (1e-5 itself is refused for a client of more than 10,000
#     sentences); the noise calibrated for T rounds in tuning too (fedpa.dp_horizon). Tuning as the tune stage (seed 0,
#     ceil(T/2) rounds, the held-out split): the 2 x 3 grid PRIVACY_CLIPS x PRIVACY_LRS per method, FedPA-LoRA at its
#     selected lambda; FedSVD without DP over LR_GRID (the other three have final runs). Then seeds 0-2 at each
#     selection, T rounds, the dev set. Endpoint: the final-round dev accuracy (paper protocol), each method under DP
#     paired with FedIT under DP (Holm over the three), and each under DP against itself without DP.
# (b) Client level, the partial setting (N = 100, K = 10), CLIENT_DP_ROUNDS rounds, seed CLIENT_DP_SEED (seed 0 of the
#     partial stage ran on a GPU): each method of CLIENT_DP_METHODS at its selected values (FedSVD, not tuned in the
#     main cell, at FFA-LoRA's) without DP, then with DP at epsilon PRIVACY_EPSILON, delta min(1e-5, 1/(10 N)) =
#     1e-5 (this line said 1e-6 before the runs, a slip of arithmetic: the rule it names gives 1e-5), and C = the
#     median over rounds of the round's mean per-client contribution norm in its own no-DP run
#     (delta_norm for fedpa, change_norm for the others): the usual median clip, chosen on the clients' data outside
#     epsilon (docs/privacy.md). Endpoint: the dev accuracy at the last round, DP against no DP, one seed: a
#     measurement, not a test.
PRIVACY_METHODS = ("fedpa", "fedit", "ffa_lora", "fedsvd")
CLIENT_DP_METHODS = ("fedpa", "fedit", "ffa_lora", "fedsa_lora", "fedsvd")
PRIVACY_EPSILON = 8.0
PRIVACY_CLIPS = (0.1, 1.0)
PRIVACY_LRS = (("AdamW", 2e-3), ("AdamW", 5e-3), ("AdamW", 1e-2))
CLIENT_DP_ROUNDS, CLIENT_DP_SEED = 30, 1


def sample_dp(clip: float, T: int) -> tuple[str, ...]:
    return ("fedpa.dp_mode", "sample", "fedpa.dp_epsilon", f"{PRIVACY_EPSILON:g}", "fedpa.dp_clip", f"{clip:g}",
            "fedpa.dp_horizon", str(T))  # fmt: skip


def privacy_tune_runs(selected: dict, T: int) -> list[Run]:
    """(a)'s tuning: each method of :data:`PRIVACY_METHODS` over the clip x rate grid under DP-SGD, and FedSVD
    without DP over :data:`LR_GRID`; seed 0, ceil(T/2) rounds, scored on the held-out split."""
    lam, runs = selected["methods"]["fedpa"]["lam"], []
    for method in PRIVACY_METHODS:
        for clip in PRIVACY_CLIPS:
            for optimizer, lr in PRIVACY_LRS:
                m_lam = lam if method == "fedpa" else None
                name = f"tune_{method}_dp_c{clip:g}_{tune_name(method, optimizer, lr, m_lam)[len(method) + 1 :]}"
                opts = (*hparams(optimizer, lr, m_lam, method), *sample_dp(clip, T), *TUNE_EVAL, *ONE_THREAD)
                runs.append(Run("privacy", name, method, opts, 0, math.ceil(T / 2)))
    for optimizer, lr in LR_GRID:
        opts = (*hparams(optimizer, lr), *TUNE_EVAL, *ONE_THREAD)
        runs.append(Run("privacy", f"tune_{tune_name('fedsvd', optimizer, lr, None)}", "fedsvd", opts, 0,
                        math.ceil(T / 2)))  # fmt: skip
    return runs


def privacy_cell(run: Run) -> str:
    """The final cell a tuning run of (a) competes for: ``<method>_dp`` under DP-SGD, else the method."""
    return f"{run.method}_dp" if "_dp_" in run.name else run.method


def privacy_selection(results: dict, runs: list[Run]) -> dict[str, dict]:
    """``{cell: {"opts": [...], "score": ...}}`` of (a): per DP method (``<method>_dp``) and FedSVD without DP the
    tuning run with the best held-out score (strictly better; the first of ties in grid order). Each cell is
    selected over its own runs only, so a cell is decided once all of its runs are in and is left out before."""
    cells: dict[str, list[Run]] = {}
    for run in runs:
        cells.setdefault(privacy_cell(run), []).append(run)
    best: dict[str, dict] = {}
    for cell, group in cells.items():
        if any(run.key not in results for run in group):
            continue
        for run in group:
            value = score(results[run.key])
            if value is not None and (cell not in best or value > best[cell]["score"]):
                keep = [x for k, v in zip(run.opts[::2], run.opts[1::2]) for x in (k, v) if k not in TUNE_EVAL[::2]]
                best[cell] = {"method": run.method, "opts": keep, "score": value, "run": run.key}
    return best


def privacy_final_runs(choice: dict[str, dict], T: int) -> list[Run]:
    """(a)'s final runs: each selected cell at seeds 0-2, T rounds, the dev set, seed-major."""
    return [Run("privacy", cell, c["method"], (*c["opts"], *FINAL_EVAL), seed, T)
            for seed in SEEDS for cell, c in sorted(choice.items())]  # fmt: skip


def client_dp_base() -> tuple[str, ...]:
    many = ("federate.client_num", str(PARTIAL_CLIENTS), "federate.sample_client_num", str(PARTIAL_SAMPLED),
            "eval.freq", str(PARTIAL_EVERY))  # fmt: skip
    return (*FINAL_EVAL, *many, *ONE_THREAD)


def client_dp_method_opts(selected: dict, method: str) -> tuple[str, ...]:
    """A method's values selected in the main cell; FedSVD, not tuned there, at its relative FFA-LoRA's."""
    chosen = selected["methods"]
    return selected_opts(chosen[method if method in chosen else "ffa_lora"])


def client_dp(clip: float, epsilon: float = PRIVACY_EPSILON) -> tuple[str, ...]:
    """Client-level DP at ``epsilon`` over the run, each contribution clipped to ``clip`` (4 significant digits)."""
    return ("fedpa.dp_mode", "client", "fedpa.dp_epsilon", f"{epsilon:g}", "fedpa.dp_clip", f"{clip:.4g}")


def client_dp_runs(selected: dict, results: dict) -> tuple[list[Run], list[Run]]:
    """(b): the no-DP runs, and the DP runs of those that have finished (their clip from the no-DP run)."""
    plain, private = [], []
    for method in CLIENT_DP_METHODS:
        opts = client_dp_method_opts(selected, method)
        base = Run("privacy", f"partial30_{method}", method, (*opts, *client_dp_base()), CLIENT_DP_SEED,
                   CLIENT_DP_ROUNDS)  # fmt: skip
        plain.append(base)
        clip = median_contribution(results.get(base.key), method)
        if clip is not None:
            private.append(Run("privacy", f"partial30_{method}_dp", method, (*base.opts, *client_dp(clip)),
                               CLIENT_DP_SEED, CLIENT_DP_ROUNDS))  # fmt: skip
    return plain, private


def median_contribution(result: dict | None, method: str) -> float | None:
    """(b)'s clip: the median over rounds of the round's mean per-client contribution norm of a no-DP run."""
    if not result:
        return None
    key = "delta_norm_mean" if method == "fedpa" else "change_norm_mean"
    values = [d[key] for d in result.get("diagnostics", []) if isinstance(d.get(key), (int, float))]
    return statistics.median(values) if values else None


def privacy_runs(selected: dict, results: dict, T: int) -> list[tuple[str, list[Run]]]:
    """The privacy stage's parts, as far as the committed results determine them."""
    tune = privacy_tune_runs(selected, T)
    parts = [("privacy: sample-level tuning", tune)]
    if choice := privacy_selection(results, tune):
        parts.append(("privacy: sample-level final", privacy_final_runs(choice, T)))
    plain, private = client_dp_runs(selected, results)
    parts.append(("privacy: client level, no DP", plain))
    parts.append(("privacy: client level, DP", private))
    return parts
