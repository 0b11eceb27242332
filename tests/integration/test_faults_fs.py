"""One client's fault is that client's problem, in real FS runs: every fault of the table (fault_cases.FAULTS,
also the table of docs/errors.md) is dropped with a reason that names the client, the run completes, and the
global adapter of that round equals the one aggregated from the honest uploads alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.integration.conftest import fedpa_cfg, probe
from tests.integration.fault_cases import FAULTS

pytestmark = pytest.mark.integration

NAMES = list(FAULTS)
GROUPS = [NAMES[i : i + 14] for i in range(0, len(NAMES), 14)]  # one FS run per group, one fault per round


def _schedule(group: list[str]) -> list[tuple[int, int, str]]:
    """(client, round, fault): round 0 is clean, then one fault per round on clients 1, 2, 3 in turn."""
    return [(1 + (rnd - 1) % 3, rnd, name) for rnd, name in enumerate(group, start=1)]


@pytest.mark.parametrize("group", GROUPS, ids=[f"faults {i * 14 + 1}-{i * 14 + len(g)}" for i, g in enumerate(GROUPS)])
def test_every_fault_is_dropped_with_its_reason_and_the_others_aggregate(tiny_llm, tmp_path, group):
    from fs_fedpa.core.reconstruct import reconstruct_adapter

    schedule = _schedule(group)
    planted = tmp_path / "pwned"
    env = {
        "FS_PROBE_CORRUPT": ",".join(f"{c}:{r}:{name}" for c, r, name in schedule),
        "FS_PROBE_CANARY": str(planted),
    }
    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"federate.total_round_num": len(group) + 1, "eval.freq": 100})
    run = probe(cfg, tmp_path, env=env, timeout=600)
    log = (tmp_path / "probe.log").read_text()
    diagnostics = {
        d["round"]: d for d in map(json.loads, (Path(run["final"]["outdir"]) / "fedpa_diagnostics.jsonl").open())
    }
    aggregates = {a["round"]: a for a in run["aggregate"]}
    sent = {(s["client"], s["round"]): s for s in run["sent"]}
    assert not planted.exists()
    assert len(diagnostics) == len(group) + 1  # the run completed every round
    for client, rnd, name in schedule:
        reason = FAULTS[name][1]
        assert diagnostics[rnd]["dropped"].keys() == {str(client)}, (name, diagnostics[rnd]["dropped"])
        assert reason in diagnostics[rnd]["dropped"][str(client)], (name, diagnostics[rnd]["dropped"])
        assert re.search(rf"round {rnd}: dropped the upload of client #{client}: .*{re.escape(reason)}", log), name
        honest = [c for c in (1, 2, 3) if c != client]
        assert sorted(diagnostics[rnd]["clients"]) == honest, name
        expected, _ = reconstruct_adapter(
            [{n: (p["B"], p["A"]) for n, p in sent[(c, rnd)]["parts"].items()} for c in honest],
            max(B.shape[1] for B, _ in aggregates[rnd]["global"].values()),
            weights=[sent[(c, rnd)]["size"] for c in honest],
            mode="reduced",
            return_spectrum=True,
        )
        for module, (B, A) in aggregates[rnd]["global"].items():
            torch.testing.assert_close(B @ A, expected[module][0] @ expected[module][1], atol=1e-6, rtol=0, msg=name)


def _round(run, rnd: int) -> dict:
    return next(a for a in run["aggregate"] if a["round"] == rnd)


def _product_norm(factors) -> float:
    return float(sum(torch.linalg.matrix_norm(B.double() @ A.double()) ** 2 for B, A in factors.values()) ** 0.5)


def _poisoned_run(tiny_llm, folder: Path, poison: str, **extra):
    folder.mkdir()
    cfg = fedpa_cfg(tiny_llm, folder, **{"federate.total_round_num": 2, "eval.freq": 100, **extra})
    run = probe(cfg, folder, env={"FS_PROBE_CORRUPT": f"2:1:{poison}"}, timeout=600)
    sent = {
        c: {n: (p["B"], p["A"]) for n, p in s["parts"].items()}
        for s in run["sent"]
        if s["round"] == 1
        for c in [s["client"]]
    }
    return run, sent, (folder / "probe.log").read_text()


def test_a_scaled_upload_dominates_by_default_and_is_dropped_by_the_norm_rule(tiny_llm, tmp_path):
    """Client 2 sends 1e4 x its B in round 1 (every value stays below the 1e6 bound)."""
    norms = {}
    for name, extra in (("default", {}), ("bounded", {"fedpa.norm_outlier": 10.0})):
        run, sent, log = _poisoned_run(tiny_llm, tmp_path / name, "B scaled by 1e4", **extra)
        honest = max(_product_norm(sent[c]) for c in (1, 3))
        norms[name] = _product_norm(_round(run, 1)["global"]) / honest
    assert norms["default"] > 100 and norms["bounded"] < 2.0, norms  # bounded: no larger than an honest update
    assert "dropped the upload of client #2: ||Delta W||" in log and "fedpa.norm_outlier(=10)" in log


def test_a_huge_sample_size_takes_the_aggregate_by_default_and_is_capped_by_the_weight_ratio(tiny_llm, tmp_path):
    """Client 2 declares 1e14 examples in round 1 (below the 1e15 bound of every upload)."""
    share = {}
    for name, extra in (("default", {}), ("bounded", {"fedpa.max_weight_ratio": 2.0})):
        run, sent, _ = _poisoned_run(tiny_llm, tmp_path / name, "sample size 1e14", **extra)
        global_ = _round(run, 1)["global"]
        gap = {
            n: (B.double() @ A.double()) - (sent[2][n][0].double() @ sent[2][n][1].double())
            for n, (B, A) in global_.items()
        }
        share[name] = float(sum(torch.linalg.matrix_norm(g) ** 2 for g in gap.values()) ** 0.5) / _product_norm(
            sent[2]
        )
    assert share["default"] < 1e-6 and share["bounded"] > 0.1, share  # default: the global is client 2's update


def test_docs_table_lists_exactly_these_faults():
    text = (ROOT / "docs" / "errors.md").read_text()
    section = text.split("### The fault table", 1)[1].split("\n#", 1)[0]  # up to the next heading
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [(c.strip().strip("`"), r.strip().strip("`")) for c, r in rows] == [(n, FAULTS[n][1]) for n in NAMES]
