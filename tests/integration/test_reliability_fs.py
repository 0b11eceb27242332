"""Reliability in real FS runs: faulty uploads are dropped with a reason, determinism per seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import fedpa_cfg, probe

pytestmark = pytest.mark.integration


def _diagnostics(run) -> list[dict]:
    return [json.loads(line) for line in (Path(run["final"]["outdir"]) / "fedpa_diagnostics.jsonl").open()]


def _product(factors):
    return {n: B.double() @ A.double() for n, (B, A) in factors.items()}


def test_faulty_uploads_are_dropped_and_training_goes_on(tiny_llm, tmp_path):
    # Execute: in round 1, client 2 uploads a NaN and client 3 an A of the wrong shape
    run = probe(fedpa_cfg(tiny_llm, tmp_path), tmp_path, env={"FS_PROBE_CORRUPT": "2:1:nan,3:1:shape"})
    # Assert: the reasons are logged and recorded
    log = (tmp_path / "probe.log").read_text()
    assert "dropped the upload of client #2" in log and "NaN or Inf in B" in log
    assert "dropped the upload of client #3" in log and "expected" in log
    diag = {d["round"]: d for d in _diagnostics(run)}
    assert sorted(diag[1]["dropped"]) == ["2", "3"] and diag[1]["clients"] == [1]
    assert diag[0]["dropped"] == {} and diag[2]["dropped"] == {}
    # the round-1 global is client 1's product alone (rank r <= R_g: reconstructed exactly)
    agg = {a["round"]: a for a in run["aggregate"]}
    alone = _product(agg[1]["uploads"][agg[1]["clients"].index(1)])
    for name, product in _product(agg[1]["global"]).items():
        torch.testing.assert_close(product, alone[name], atol=1e-5, rtol=1e-4)
    # training went on: round 2 aggregated all three, and everything stays finite
    assert sorted(agg[2]["clients"]) == [1, 2, 3] and diag[2]["clients"] and len(run["aggregate"]) == 3
    for B, A in run["final"]["global"].values():
        assert torch.isfinite(B).all() and torch.isfinite(A).all()


def test_a_round_with_every_upload_dropped_keeps_the_global_adapter(tiny_llm, tmp_path):
    run = probe(fedpa_cfg(tiny_llm, tmp_path), tmp_path, env={"FS_PROBE_CORRUPT": "1:1:nan,2:1:nan,3:1:shape"})
    log = (tmp_path / "probe.log").read_text()
    assert "every upload was dropped; the global adapter stays as it was" in log
    agg = {a["round"]: a for a in run["aggregate"]}
    for name, (B, A) in agg[1]["global"].items():  # bit for bit the round-0 global
        assert torch.equal(B, agg[0]["global"][name][0]) and torch.equal(A, agg[0]["global"][name][1])
    assert not any(torch.equal(B, agg[1]["global"][n][0]) for n, (B, _) in agg[2]["global"].items())
    assert len(_diagnostics(run)) == 3 and _diagnostics(run)[1]["clients"] == []


def test_same_seed_same_run_other_seed_other_run(tiny_llm, tmp_path):
    runs = [
        probe(fedpa_cfg(tiny_llm, tmp_path / name), tmp_path / name, "seed", seed)
        for name, seed in (("a", "3"), ("b", "3"), ("c", "4"))
    ]
    for x, y in ((runs[0], runs[1]),):
        for name, (B, A) in x["final"]["global"].items():
            assert torch.equal(B, y["final"]["global"][name][0]) and torch.equal(A, y["final"]["global"][name][1])
        for cid, factors in x["final"]["clients"].items():
            for name, (B, A) in factors.items():
                assert torch.equal(B, y["final"]["clients"][cid][name][0])
                assert torch.equal(A, y["final"]["clients"][cid][name][1])
        assert (Path(x["final"]["outdir"]) / "eval_results.log").read_text() == (
            Path(y["final"]["outdir"]) / "eval_results.log"
        ).read_text()
    other = runs[2]["final"]["global"]
    assert any(not torch.equal(B, other[n][0]) for n, (B, _) in runs[0]["final"]["global"].items())
