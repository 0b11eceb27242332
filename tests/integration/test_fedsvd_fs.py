"""FedSVD selected by federate.method in stock FS: clients keep A fixed, the server re-factors it every round."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.conftest import fedpa_cfg, probe

pytestmark = pytest.mark.integration


def test_fedsvd_clients_never_change_A_and_the_server_re_factors_it_with_orthonormal_rows(tiny_llm, tmp_path):
    # Execute
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "fedsvd"}), tmp_path)
    # Assert: within a round, a client's A is the one it started from (it trains B only)
    starts = {(e["client"], e["round"]): e["start"] for e in run["enter"]}
    assert run["leave"]
    for left in run["leave"]:
        for name, (_, A) in left["end"].items():
            assert torch.equal(A, starts[left["client"], left["round"]][name][1])
    initial = next(e["start"] for e in run["enter"] if e["round"] == 0)
    for _, A in initial.values():  # the server's first A, orthonormalised
        torch.testing.assert_close(A @ A.T, torch.eye(A.shape[0]), atol=1e-5, rtol=0)
    # each round's global: orthonormal A, the exact mean of the clients' products, an A that moved once B did
    assert run["aggregate"]
    for agg in run["aggregate"]:
        total = sum(agg["weights"])
        for name, (B_g, A_g) in agg["global"].items():
            mean = sum(w / total * (u[name][0].double() @ u[name][1].double()) for w, u in zip(agg["weights"],
                       agg["uploads"]))  # fmt: skip
            torch.testing.assert_close(A_g @ A_g.T, torch.eye(A_g.shape[0]), atol=1e-5, rtol=0)
            torch.testing.assert_close(B_g.double() @ A_g.double(), mean, atol=1e-6, rtol=1e-4)
            assert bool(B_g.any()) and not torch.allclose(A_g, initial[name][1], atol=1e-3)
    # and the next round's clients start from that A
    globals_ = {agg["round"]: agg["global"] for agg in run["aggregate"]}
    later = [e for e in run["enter"] if e["round"] > 0]
    assert later
    for entry in later:
        for name, (_, A) in entry["start"].items():
            torch.testing.assert_close(A, globals_[entry["round"] - 1][name][1], atol=0, rtol=0)
    with open(f"{run['final']['outdir']}/fedpa_diagnostics.jsonl") as f:  # the spectrum of each aggregate
        spectra = [json.loads(line)["spectrum_probe"] for line in f]
    assert spectra and all(s and s == sorted(s, reverse=True) for s in spectra)
