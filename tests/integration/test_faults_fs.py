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


def test_docs_table_lists_exactly_these_faults():
    text = (ROOT / "docs" / "errors.md").read_text()
    section = text.split("### The fault table", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [(c.strip().strip("`"), r.strip().strip("`")) for c, r in rows] == [(n, FAULTS[n][1]) for n in NAMES]
