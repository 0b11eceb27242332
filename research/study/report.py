"""The SST-2 protocol's report, rebuilt from the committed run files alone (:mod:`research.study.sst2_protocol`).

Writes into the report folder: ``report.md`` (setting, pilot, the whole tuning table, the selected values, the final
table with paired intervals against FedPA-LoRA under both evaluation protocols, the settings beyond the main cell,
the CPU time spent and what is still to run), ``tuning.csv``, and per finished stage the tables and figures of
:mod:`research.harness.compare` (``final/results.md``, ``final/accuracy.png``, ``final/mechanism.png``, ...).

This module puts the sections in order; each is written by a module of its own: :mod:`.report_verdict` (verdict,
deployment, head, client splits), :mod:`.report_tuning` (pilot, tuning, selection, stages, mechanism, λ),
:mod:`.report_long` (long horizon, partial participation), :mod:`.report_privacy` and :mod:`.report_dp_regime`.
"""

from __future__ import annotations

import json
from pathlib import Path

from research.study import protocol_results as pr
from research.study import sst2_verdict as sv
from research.study.report_dp_regime import dp_regime_section
from research.study.report_dp_fedpa import dp_fedpa_section
from research.study.report_dp_valid import dp_valid_section
from research.study.report_long import long_section, partial_section
from research.study.report_privacy import privacy_section
from research.study.report_tuning import (
    edge_section,
    lambda_section,
    mechanism_section,
    pilot_section,
    selected_section,
    stage_section,
    tuning_section,
)
from research.study.report_verdict import (
    deployment_section,
    head_section,
    splits_section,
    verdict_figure,
    verdict_section,
)


def write_report(report: Path, results: dict, stages: list) -> Path:
    report.mkdir(parents=True, exist_ok=True)
    spent = pr.time_spent(results)
    pending = [(stage, sum(r.key not in results for r in runs)) for stage, runs in stages]
    finals = {r["cell"] for k, r in results.items() if k.startswith("final/")}
    lines = [
        "# SST-2 protocol: results",
        "",
        "Rebuilt by `./run.sh compare` from the run files in `runs/` (docs/study/sst2_protocol.md describes the "
        "protocol).",
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
        *dp_valid_section(results, main := json.loads(selected.read_text())
                          if (selected := report / "selected.json").is_file() else None),
        *dp_fedpa_section(results, main),
    ]  # fmt: skip
    path = report / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _finals(results: dict) -> dict:
    """The final FedPA-LoRA runs re-keyed into another stage, as the reference of the ablation and adaptive cells."""
    return {f"{stage}/{k.split('/', 1)[1]}": r for k, r in results.items() if k.startswith("final/fedpa_s")
            for stage in ("ablation", "adaptive")}  # fmt: skip
