"""The sample-level server's check of each client's DP account (issue 88): a client's account, however absurd, is
refused naming the client and the field, before any accounting; the accounting of one client's account never ends
the run; a client that sent without DP is stated with no guarantee (epsilon null), never the plan's epsilon. The
server is built without FS: its config is the few keys the plan reads."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

pytest.importorskip("dp_accounting", reason="dp-accounting (the dp extra) is not installed: accounts NOT checked")

N_I, BATCH, STEPS, Z = 20, 4, 2, 1.5


def _server(tmp_path, **dp):
    """A SampleLevelServer of 3 clients and 3 rounds: b = 4, 2 steps a round, z = 1.5, C = 1."""
    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.privacy.sample_level import SampleLevelServer

    fedpa = FedPAConfig()
    for key, value in {"mode": "sample", "clip": 1.0, "noise_multiplier": Z, "seed": 0, **dp}.items():
        setattr(fedpa.dp, key, value)
    cfg = SimpleNamespace(
        outdir=str(tmp_path), fedpa=fedpa,
        dataloader=SimpleNamespace(batch_size=BATCH, drop_last=False),
        train=SimpleNamespace(batch_or_epoch="batch", local_update_steps=STEPS),
        federate=SimpleNamespace(total_round_num=3),
    )  # fmt: skip
    method = SimpleNamespace(cfg=fedpa, personal_weight=None)
    return SampleLevelServer(cfg, method, clients=3, rounds=3, per_round=3, shared_names=(), global_factors={})


def _honest(server, rounds_trained: int = 1, n: int = N_I) -> dict:
    """What an honest client of n records uploads after ``rounds_trained`` rounds (SampleLevelClient.spent)."""
    plan = server._plan(n)
    steps = rounds_trained * plan.steps_per_round
    return {"num_train_data": n, "dp_n": n, "dp_b": plan.b, "dp_steps": steps, "dp_z": plan.z, "dp_clip": 1.0,
            "dp_delta": plan.delta, "dp_epsilon": plan.epsilon(steps)}  # fmt: skip


def _faults(tmp_path) -> list[dict]:
    path = tmp_path / "fedpa_dp_faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_an_honest_account_is_admitted_and_its_epsilon_is_the_plans(tmp_path):
    # Prepare
    server = _server(tmp_path)
    stats = {c: _honest(server) for c in (1, 2, 3)}
    # Execute
    refused = server.admit(0, stats)
    line = server.account(0, [1, 2, 3], stats)
    # Assert: dp-accounting's figure for 2 steps of b=4 of 20 at z=1.5, independently composed
    import dp_accounting as dpa
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    event = dpa.SampledWithoutReplacementDpEvent(N_I, BATCH, dpa.GaussianDpEvent(Z / 2))
    accountant = rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    expected = accountant.compose(dpa.SelfComposedDpEvent(event, STEPS)).get_epsilon(1e-5)  # min(1e-5, 1/(10 n))
    assert refused == {} and _faults(tmp_path) == []
    assert line["dp_epsilon"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("field", "value", "dp"),
    [
        ("dp_steps", 10**15, {"accountant": "pld"}),  # the PLD accountant asked for 5e8 GiB and the run ended
        ("dp_steps", 10**15, {}),
        ("dp_n", 10**6, {"delta": 1e-5}),  # delta 1e-5 is above 1/(10 n): no honest client of 10^6 records starts
        ("dp_b", 10**6, {}),
        ("dp_steps", -3, {}),
        ("dp_n", -5, {}),
        ("dp_z", -1.0, {}),
    ],
)
def test_an_absurd_account_is_refused_naming_the_client_and_the_field_and_the_run_goes_on(tmp_path, field, value, dp):
    """Issue 88: an account with absurd values raised in the server (the plan of 10^6 records at delta 1e-5, the
    PLD of 10^15 steps) and ended the run. Now the upload is refused before any accounting, naming the client and
    the field, in fedpa_dp_faults.jsonl, and the honest clients' accounts are stated as before."""
    # Prepare
    server = _server(tmp_path, **dp)
    stats = {c: _honest(server) for c in (1, 2, 3)}
    stats[2][field] = value
    stats[2]["dp_epsilon"] = 1e4  # what it says it spent: more than the plan, so the ledger would account its claim
    # Execute
    refused = server.admit(0, stats)
    line = server.account(0, [1, 2, 3], stats)
    # Assert
    assert list(refused) == [2] and field in refused[2]
    assert [(f["client"], field in f["reason"]) for f in _faults(tmp_path)] == [("2", True)]
    honest = _honest(server)["dp_epsilon"]
    assert line["dp_clients"]["1"]["epsilon"] == line["dp_clients"]["3"]["epsilon"] == honest
    assert server.summary()  # the run's last line is written


def test_an_exception_in_one_clients_accounting_drops_that_client_not_the_run(tmp_path, monkeypatch):
    """Whatever the accountant raises for one client's account (a bound this check does not know of), that client's
    upload is refused and its entry states no guarantee; the others are accounted."""
    # Prepare
    from fs_fedpa.privacy import sample_level

    server = _server(tmp_path)
    stats = {c: _honest(server, n=N_I + c) for c in (1, 2, 3)}
    real = sample_level.SamplePlan.epsilon

    def epsilon(plan, steps):
        if plan.n == N_I + 2:
            raise MemoryError("the accountant of client 2's account")
        return real(plan, steps)

    monkeypatch.setattr(sample_level.SamplePlan, "epsilon", epsilon)
    # Execute
    refused = server.admit(0, stats)
    line = server.account(0, [1, 2, 3], stats)
    # Assert
    assert list(refused) == [2] and "MemoryError" in refused[2]
    assert line["dp_clients"]["2"]["guarantee"] == "none" and line["dp_clients"]["1"]["epsilon"] < math.inf


def test_a_client_that_sent_without_dp_is_stated_with_no_guarantee(tmp_path):
    """Issue 88: a client whose own config says fedpa.dp.mode none sends raw factors and no account. Its upload was
    dropped, but the ledger credited it with the server's plan (epsilon 6.52) and the headline stated that. Now its
    entry states no guarantee (epsilon null) with the reason, the faults file says so, and the headline states no finite epsilon."""
    # Prepare
    server = _server(tmp_path)
    stats = {c: _honest(server) for c in (1, 3)}
    stats[2] = {"num_train_data": N_I, "lam": 1.0}  # no DP account at all
    # Execute
    refused = server.admit(0, stats)
    line = server.account(0, [1, 2, 3], stats)
    # Assert
    assert list(refused) == [2]
    entry = line["dp_clients"]["2"]
    assert entry["epsilon"] is None and entry["guarantee"] == "none" and "without DP" in entry["reason"]
    assert line["dp_epsilon"] is None and line["dp_no_guarantee"] == ["2"]
    json.dumps(line, allow_nan=False)  # the ledger stays standard JSON
    assert [f["client"] for f in _faults(tmp_path)] == ["2"] and "without DP" in _faults(tmp_path)[0]["reason"]
    assert "no guarantee" in server.summary() and "client 2" in server.summary()
    # and it stays without a guarantee when a later round's upload carries an account
    stats = {c: _honest(server, 2) for c in (1, 2, 3)}
    server.admit(1, stats)
    assert server.account(1, [1, 2, 3], stats)["dp_clients"]["2"]["guarantee"] == "none"
