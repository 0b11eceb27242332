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
    text = (ROOT / "docs" / "dev" / "faults.md").read_text()
    section = text.split("## The fault table", 1)[1].split("\n#", 1)[0]  # up to the next heading
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [(c.strip().strip("`"), r.strip().strip("`")) for c, r in rows] == [(n, FAULTS[n][1]) for n in NAMES]


def _diagnostics(run) -> dict[int, dict]:
    """The run's diagnostics file by round, parsed as standard JSON (NaN and Infinity refused)."""

    def refuse(constant):
        raise ValueError(f"the diagnostics file holds {constant}, which is not JSON")

    path = Path(run["final"]["outdir"]) / "fedpa_diagnostics.jsonl"
    return {d["round"]: d for d in (json.loads(line, parse_constant=refuse) for line in path.open())}


def _honest_global(run, rnd: int, clients: list[int], weights: list[float]):
    """The global adapter of round ``rnd`` computed independently from what ``clients`` sent, with ``weights``."""
    from fs_fedpa.core.reconstruct import reconstruct_adapter

    sent = {(s["client"], s["round"]): s for s in run["sent"]}
    rank = max(B.shape[1] for B, _ in _round(run, rnd)["global"].values())
    uploads = [{n: (p["B"], p["A"]) for n, p in sent[(c, rnd)]["parts"].items()} for c in clients]
    expected, _ = reconstruct_adapter(uploads, rank, weights=weights, mode="reduced", return_spectrum=True)
    return {n: B @ A for n, (B, A) in expected.items()}


def _assert_global_is(run, rnd: int, expected: dict, rtol: float = 0.0):
    for module, (B, A) in _round(run, rnd)["global"].items():
        atol = 1e-6 + rtol * float(expected[module].abs().max())
        torch.testing.assert_close(B @ A, expected[module], atol=atol, rtol=0, msg=f"round {rnd}, {module}")


def test_a_huge_legal_upload_overflows_diagnostics_and_no_honest_upload_is_dropped(tiny_llm, tmp_path):
    """Client 2 sends every factor entry at 9.9e5 in round 1 (legal: below the 1e6 bound). Until issue 87 the honest
    clients' next gradient ratios overflowed (the autograd term's float32 gradient); the closed-form gradient keeps
    them finite (about 1e13), so client 3 also reports an overflowed gradient ratio in round 2. A diagnostic that is
    not finite is a diagnostic problem: every upload of every round is aggregated."""
    # Prepare / Execute
    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"federate.total_round_num": 5, "eval.freq": 100})
    faults = "2:1:every entry 9.9e5,3:2:gradient ratio overflowed"
    run = probe(cfg, tmp_path, env={"FS_PROBE_CORRUPT": faults}, timeout=600)
    diagnostics, log = _diagnostics(run), (tmp_path / "probe.log").read_text()
    # Assert: the run completed, nothing was dropped, and a non-finite stat was met and recorded as such
    assert sorted(diagnostics) == [0, 1, 2, 3, 4]
    assert all(d["dropped"] == {} and sorted(d["clients"]) == [1, 2, 3] for d in diagnostics.values()), diagnostics
    overflowed = {r: d["nonfinite_stats"] for r, d in diagnostics.items() if d["nonfinite_stats"]}
    assert overflowed, "no stat overflowed: the case no longer exercises a non-finite diagnostic"
    for rnd, named in overflowed.items():
        for client, stats in named.items():
            assert f"round {rnd}: client #{client} reported stats that are not finite ({', '.join(stats)})" in log
            assert all(client not in diagnostics[rnd][stat] for stat in stats)  # left out, not averaged
    # every round's global is the aggregate of all three uploads as they arrived (the probe's own decode, client 2's
    # huge one included), weighted by their sample sizes
    from fs_fedpa.core.reconstruct import reconstruct_adapter

    for rnd in diagnostics:
        agg = _round(run, rnd)
        rank = max(B.shape[1] for B, _ in agg["global"].values())
        expected = reconstruct_adapter(agg["uploads"], rank, weights=agg["weights"], mode="reduced")
        _assert_global_is(run, rnd, {n: B @ A for n, (B, A) in expected.items()}, rtol=1e-5)


def test_flexlora_bounds_num_train_data_and_drops_only_the_offender(tiny_llm, tmp_path):
    """FlexLoRA weighs uploads by the clients' num_train_data: client 1 reports -5 in round 1 (the culprit search
    used to drop honest client 3), client 2 reports 10**30 in round 2 (the global used to be its update)."""
    # Prepare / Execute
    faults = {1: (1, "num_train_data < 0"), 2: (2, "num_train_data 10**30")}
    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "flexlora", "eval.freq": 100})
    env = {"FS_PROBE_CORRUPT": ",".join(f"{c}:{r}:{name}" for r, (c, name) in faults.items())}
    run = probe(cfg, tmp_path, env=env, timeout=600)
    diagnostics, log = _diagnostics(run), (tmp_path / "probe.log").read_text()
    sent = {(s["client"], s["round"]): s for s in run["sent"]}
    # Assert
    assert sorted(diagnostics) == [0, 1, 2] and diagnostics[0]["dropped"] == {}
    for rnd, (client, name) in faults.items():
        reason = FAULTS[name][1]
        assert diagnostics[rnd]["dropped"].keys() == {str(client)}, diagnostics[rnd]["dropped"]
        assert reason in diagnostics[rnd]["dropped"][str(client)]
        assert f"round {rnd}: dropped the upload of client #{client}: stats {reason}" in log
        honest = [c for c in (1, 2, 3) if c != client]
        assert sorted(diagnostics[rnd]["clients"]) == honest
        weights = [sent[(c, rnd)]["stats"]["num_train_data"] for c in honest]  # FlexLoRA's weights, as reported
        _assert_global_is(run, rnd, _honest_global(run, rnd, honest, weights))


def test_zero_size_clients_weigh_nothing_and_the_weight_cap_keeps_the_honest_client(tiny_llm, tmp_path):
    """With fedpa.max_weight_ratio, clients 1 and 2 declare 0 examples in round 1 (the cap used to weigh every
    client 0 and the search then dropped honest client 3); in round 2 all three do, and weigh equally."""
    # Prepare / Execute
    zero = {1: [1, 2], 2: [1, 2, 3]}
    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"fedpa.max_weight_ratio": 2.0, "eval.freq": 100})
    env = {"FS_PROBE_CORRUPT": ",".join(f"{c}:{r}:sample size 0" for r, cs in zero.items() for c in cs)}
    run = probe(cfg, tmp_path, env=env, timeout=600)
    diagnostics = _diagnostics(run)
    sent = {(s["client"], s["round"]): s for s in run["sent"]}
    # Assert: nobody is dropped; round 1 is client 3's update alone, as if 1 and 2 had sent nothing
    assert all(d["dropped"] == {} and sorted(d["clients"]) == [1, 2, 3] for d in diagnostics.values()), diagnostics
    weights = dict(zip(diagnostics[1]["clients"], diagnostics[1]["weights"]))
    assert weights == {1: 0.0, 2: 0.0, 3: sent[(3, 1)]["size"]}
    _assert_global_is(run, 1, _honest_global(run, 1, [3], [1.0]))
    # round 2: every weight is 0, so the round weighs its uploads equally
    assert diagnostics[2]["weights"] == [1.0, 1.0, 1.0]
    _assert_global_is(run, 2, _honest_global(run, 2, [1, 2, 3], [1.0, 1.0, 1.0]))
