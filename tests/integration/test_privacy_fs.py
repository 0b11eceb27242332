"""Differential privacy through stock FederatedScope: the ledger matches dp-accounting for the event the run used,
sample mode records each client's epsilon, refusals name DP and what is refused, what leaves a client under DP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import fedpa_cfg
from tests.integration.tiny_assets import outdir_of, run_fs

pytestmark = pytest.mark.integration
dpa = pytest.importorskip("dp_accounting", reason="dp-accounting (the dp extra) is not installed")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _finished(cfg: dict, tmp_path: Path) -> Path:
    """The output folder of an FS run of ``cfg`` that must succeed."""
    proc = run_fs(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return outdir_of(cfg)


def _expected_epsilon(N, K, z, rounds, delta, neighboring="REPLACE_ONE", sensitivity=2.0):
    """dp-accounting composing the run's event from scratch: K of N without replacement, Gaussian noise z C over
    a replace-one sensitivity of 2C (dp-accounting's Gaussian takes unit sensitivity: multiplier z / 2)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    gaussian = dpa.GaussianDpEvent(z / sensitivity)
    event = gaussian if K == N else dpa.SampledWithoutReplacementDpEvent(N, K, gaussian)
    accountant = rdp.RdpAccountant(neighboring_relation=getattr(dpa.NeighboringRelation, neighboring))
    accountant.compose(dpa.SelfComposedDpEvent(event, rounds))
    return accountant.get_epsilon(delta)


def test_client_level_ledger_equals_dp_accounting_for_the_run(tiny_llm, tmp_path):
    # Prepare: 4 clients, 2 sampled a round, 3 rounds, z = 1.2
    overrides = {
        "federate.client_num": 4,
        "federate.sample_client_num": 2,
        "fedpa.dp.mode": "client",
        "fedpa.dp.clip": 0.05,
        "fedpa.dp.noise_multiplier": 1.2,
        "fedpa.records.diagnostics": "off",
        "fedpa.dp.seed": 7,
    }
    cfg = fedpa_cfg(tiny_llm, tmp_path, **overrides)
    # Execute
    out = _finished(cfg, tmp_path)
    # Assert
    ledger = _jsonl(out / "fedpa_privacy.jsonl")  # written with diagnostics off
    assert [line["round"] for line in ledger] == [0, 1, 2]
    delta = min(1e-5, 1 / 40)
    for t, line in enumerate(ledger, 1):
        assert line["dp_epsilon"] == pytest.approx(_expected_epsilon(4, 2, 1.2, t, delta), rel=1e-9)
        assert line["dp_delta"] == delta and line["dp_sampling"] == "wor" and line["dp_adjacency"] == "replace_one"
        assert line["dp_sensitivity"] == pytest.approx(2 * 0.05 / 2) and line["dp_noise_multiplier"] == 1.2
    # with z itself (add/remove reading) the ledger would claim less: the z/2 matters
    assert ledger[-1]["dp_epsilon"] > 1.5 * _expected_epsilon(4, 2, 1.2, 3, delta, sensitivity=1.0)
    log = (out / "exp_print.log").read_text().strip().splitlines()
    assert "differential privacy (client level): (epsilon, delta)" in log[-1]  # the run's last line
    assert not (out / "fedpa_diagnostics.jsonl").exists()
    # fedpa.dp.seed 7: a warning, not an INFO line that also said "from OS entropy"
    text = "\n".join(log)
    assert "holds only while the seed stays secret" in text and "from OS entropy" not in text


def test_client_level_records_only_what_the_release_gives(tiny_llm, tmp_path):
    overrides = {
        "federate.client_num": 3,
        "fedpa.dp.mode": "client",
        "fedpa.dp.clip": 0.05,
        "fedpa.dp.epsilon": 50.0,
        "federate.total_round_num": 2,
    }
    cfg = fedpa_cfg(tiny_llm, tmp_path, **overrides)
    out = _finished(cfg, tmp_path)
    ledger = _jsonl(out / "fedpa_privacy.jsonl")
    # the target epsilon is met (z calibrated for the whole run), and nearly reached
    assert 40.0 < ledger[-1]["dp_epsilon"] <= 50.0
    z = ledger[-1]["dp_noise_multiplier"]
    assert ledger[-1]["dp_epsilon"] == pytest.approx(_expected_epsilon(3, 3, z, 2, 1e-5), rel=1e-9)
    # no dp_seed: the noise and the sampling come from the OS's cryptographic generator (fedpa.dp.secure_rng)
    assert "from the OS's cryptographic generator" in (out / "exp_print.log").read_text()
    records = _jsonl(out / "fedpa_diagnostics.jsonl")
    per_client = {"alignment_loss", "lam", "delta_norm", "drift", "num_train_data", "grad_ratio_first", "e_init_B"}
    for record in records:
        assert record["e_agg"] is not None and record["spectrum_probe"]
        for key in per_client:
            assert not record.get(key), f"{key} leaves the mechanism: {record.get(key)}"


def test_client_level_keeps_a_dropped_upload_and_its_reason_out_of_the_logs_and_diagnostics(tiny_llm, tmp_path):
    """Client 2 sends a NaN in round 1 (a diverged training: a fact of its data). Before, the diagnostics recorded
    the accepted clients and the reason, and the log named both. Now the record names the K receivers the DP
    generator drew, the log says nothing of the drop, and the reason is in the server-private faults file."""
    from tests.integration.conftest import probe

    overrides = {"federate.client_num": 3, "fedpa.dp.mode": "client", "fedpa.dp.clip": 0.05,
                 "fedpa.dp.noise_multiplier": 1.0, "federate.total_round_num": 2}  # fmt: skip
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **overrides), tmp_path, env={"FS_PROBE_CORRUPT": "2:1:nan"})
    out = Path(run["final"]["outdir"])
    records = {r["round"]: r for r in _jsonl(out / "fedpa_diagnostics.jsonl")}
    assert records[1]["clients"] == [1, 2, 3]  # every receiver, client 2 included
    assert not records[1].get("dropped") and not records[1].get("bytes_up")
    faults = _jsonl(out / "fedpa_dp_faults.jsonl")
    assert [(f["round"], f["client"]) for f in faults] == [(1, "2")] and "NaN or Inf in B" in faults[0]["reason"]
    logs = (out / "exp_print.log").read_text() + (tmp_path / "probe.log").read_text()
    assert "dropped the upload" not in logs and "NaN or Inf in B" not in logs
    assert len(_jsonl(out / "fedpa_privacy.jsonl")) == 2  # the round was released all the same


def test_client_level_server_files_hold_the_initial_head_not_a_clients(tiny_glue, tmp_path):
    """federate.share_local_model (as the protocol sets it): the server's model object is the clients', so FS's
    checkpoint and the resume point held the head of the last client that trained, without DP. Under client-level
    DP both now hold the head's initial values: the same in the resume point of round 2 and in the final
    checkpoint, and none of the clients' trained heads."""
    from tests.integration.tiny_assets import fs_glue_yaml

    save_to = tmp_path / "ckpt" / "run.pt"
    cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"], **{
        "fedpa.dp.mode": "client", "fedpa.dp.clip": 1.0, "fedpa.dp.noise_multiplier": 1.0,
        "federate.total_round_num": 3, "federate.save_to": str(save_to)})  # fmt: skip
    assert cfg["federate"]["share_local_model"] and cfg["personalization"]["local_param"] == ["classifier"]
    _finished(cfg, tmp_path)

    def heads(state: dict) -> dict:
        return {k: v for k, v in state.items() if "classifier" in k}

    final = heads(torch.load(save_to, weights_only=True, map_location="cpu")["model"])
    point = save_to.parent / f"fedpa_resume_{save_to.name}"
    resumed = heads(torch.load(point, weights_only=True, map_location="cpu")["model"])
    assert final and set(final) == set(resumed)
    assert all(torch.equal(final[k], resumed[k]) for k in final)  # written two rounds apart: not a live head
    trained = [torch.load(p, weights_only=True, map_location="cpu")["local"] for p in sorted(save_to.parent.glob(
        f"{point.name}.client*.r*"))]  # fmt: skip
    assert trained
    for local in trained:
        for name, tensor in local.items():
            match = [k for k in final if k.endswith(name) or name.endswith(k)]
            assert match and not torch.equal(final[match[0]], tensor), name


def test_an_unsupported_method_is_refused_through_fs_naming_dp(tiny_llm, tmp_path):
    overrides = {"federate.method": "flexlora", "fedpa.dp.mode": "client", "fedpa.dp.clip": 1.0,
                 "fedpa.dp.noise_multiplier": 1.0}  # fmt: skip
    proc = run_fs(fedpa_cfg(tiny_llm, tmp_path, **overrides), tmp_path)
    assert proc.returncode != 0
    assert "differential privacy at client level (fedpa.dp.mode client) is not supported by federate.method " in (
        proc.stderr
    )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["federate.method", "ravan", "fedpa.dp.mode", "client"], r"differential privacy.*'ravan'"),
        (["fedpa.dp.mode", "client", "fedpa.adaptive_lam", "loss"], "adaptive_lam.*differential privacy"),
        (["fedpa.dp.mode", "sample", "fedpa.adaptive_lam", "grad"], "adaptive_lam.*differential privacy"),
        (["fedpa.dp.mode", "client", "fedpa.norm_outlier", "3.0"], "norm_outlier with differential privacy"),
        (["fedpa.dp.mode", "client", "fedpa.max_weight_ratio", "2.0"], "max_weight_ratio with differential privacy"),
        (["fedpa.dp.mode", "client", "fedpa.dp.delta", "1e-3"], r"dp.delta\(=0.001\) must be <= 1e-05"),
        (
            ["federate.client_num", "200000", "fedpa.max_clients", "200000", "fedpa.dp.mode", "client",
             "fedpa.dp.delta", "1e-5"],
            r"above min\(1e-5, 1/\(10 x 200000 N clients\)\)",
        ),  # fmt: skip
        (["fedpa.dp.mode", "client", "fedpa.dp.epsilon", "4.0"], "exactly one of"),
        (["fedpa.dp.mode", "sample", "fedpa.dp.clip", "0.0"], "needs fedpa.dp.clip"),
        (["fedpa.dp.mode", "client", "federate.unseen_clients_rate", "0.2"], r"unseen_clients_rate\(=0.2\) with"),
        (["fedpa.dp.mode", "none", "fedpa.dp.noise_multiplier", "1.0"], "set while fedpa.dp.mode is 'none'"),
        (["fedpa.dp.mode", "none", "fedpa.dp.noise_multiplier", "0.0", "fedpa.dp.sampling", "poisson"],
         "fedpa.dp.sampling=poisson set while fedpa.dp.mode is 'none'"),
        (["fedpa.dp.mode", "sample", "fedpa.dp.accountant", "prv"], r"fedpa.dp.accountant\(='prv'\) must be one of"),
        (["fedpa.dp.mode", "sample", "fedpa.dp.sampling", "shuffle"], r"fedpa.dp.sampling\(='shuffle'\) must be one"),
        (["fedpa.dp.mode", "client", "fedpa.dp.local_tensors", "frozen"], "is a choice of DP-SGD"),
        (["fedpa.dp.mode", "client", "fedpa.dp.local_tensors", "grouped"], "is a choice of DP-SGD"),
        (["fedpa.dp.mode", "sample", "fedpa.dp.local_clip", "0.5"], "local_clip.*needs fedpa.dp.local_tensors grouped"),
        (["fedpa.dp.mode", "sample", "fedpa.dp.local_tensors", "grouped", "fedpa.dp.local_clip", "-1.0"],
         r"fedpa.dp.local_clip\(=-1.0\) must be a finite number >= 0"),
        # issue 73: before, accepted; the first two then asked for 15-30 GiB, or stopped with an ArithmeticError
        (["fedpa.dp.mode", "sample", "fedpa.dp.noise_multiplier", "0.001", "fedpa.dp.accountant", "pld"],
         r"the PLD accountant would need about .* GiB for noise multiplier z=0.001"),
        (["fedpa.dp.mode", "sample", "fedpa.dp.noise_multiplier", "0.0", "fedpa.dp.epsilon", "1000",
          "fedpa.dp.accountant", "pld"], r"fedpa.dp.epsilon\(=1000\) must be <= 100"),
        (["fedpa.dp.mode", "client", "fedpa.dp.min_records", "5"], "dp.min_records is a choice of DP-SGD"),
        (["fedpa.dp.mode", "none", "fedpa.dp.noise_multiplier", "0.0", "fedpa.dp.clip", "0.0",
          "fedpa.dp.secure_rng", "False"], "fedpa.dp.secure_rng=False set while fedpa.dp.mode is 'none'"),
        (["fedpa.dp.mode", "sample", "fedpa.dp.clip", "1.0", "fedpa.dp.noise_multiplier", "1.0",
          "fedpa.dp.local_tensors", "plain"], "'plain' is withdrawn: .* sensitivity bound does not hold"),
        (
            [
                "fedpa.dp.mode",
                "sample",
                "fedpa.dp.epsilon",
                "4.0",
                "fedpa.dp.noise_multiplier",
                "0.0",
                "fedpa.dp.horizon",
                "1",
            ],
            "dp.horizon.*below federate.total_round_num",
        ),  # fmt: skip
    ],
)
def test_refusals_name_dp(overrides, match):
    """Each refusal at FS's config check (what main.py runs before any data or model is built)."""
    from federatedscope.core.configs.config import global_cfg

    cfg = global_cfg.clone()
    base = ["federate.method", "fedpa", "federate.client_num", "3", "federate.total_round_num", "3",
            "fedpa.dp.clip", "1.0", "fedpa.dp.noise_multiplier", "1.0"]  # fmt: skip
    with pytest.raises(ValueError, match=match):
        cfg.merge_from_list(base + overrides)


def test_sample_level_records_each_clients_epsilon(tiny_llm, tmp_path):
    # Prepare: 3 clients, 2 rounds of 2 DP-SGD steps of b = 2
    overrides = {
        "fedpa.dp.mode": "sample",
        "fedpa.dp.clip": 1.0,
        "fedpa.dp.noise_multiplier": 1.5,
        "fedpa.dp.delta": 1e-4 / 10,
        "federate.total_round_num": 2,
    }
    cfg = fedpa_cfg(tiny_llm, tmp_path, **overrides)
    out = _finished(cfg, tmp_path)
    ledger = _jsonl(out / "fedpa_privacy.jsonl")
    assert len(ledger) == 2
    last = ledger[-1]
    assert set(last["dp_clients"]) == {"1", "2", "3"}
    for entry in last["dp_clients"].values():
        assert entry["steps"] == 4 and entry["b"] == 2
        expected = _expected_epsilon(entry["n"], 2, 1.5, 4, entry["delta"])
        assert entry["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert last["dp_epsilon"] == max(e["epsilon"] for e in last["dp_clients"].values())
    # each client's own accounting file: a line a round, its figure the ledger's, its noise/signal what the run file
    # reads (research's compare.collect), with no number taken from a log line
    own = _jsonl(out / "fedpa_client_privacy.jsonl")
    assert sorted((r["client"], r["round"]) for r in own) == [(c, r) for c in (1, 2, 3) for r in (0, 1)]
    for row in (r for r in own if r["round"] == 1):
        entry = last["dp_clients"][str(row["client"])]
        assert (row["epsilon"], row["steps"], row["n"]) == (entry["epsilon"], entry["steps"], entry["n"])
        assert row["clipped_sum"] > 0 and row["noise"] > 0
    records = _jsonl(out / "fedpa_diagnostics.jsonl")
    # statistics of the DP factors are post-processing; the task-gradient ratios (raw data) are not sent
    assert all(not r.get("grad_ratio_first") and not r.get("grad_ratio_last") for r in records)
    assert all(r["delta_norm"] for r in records)
    log = (out / "exp_print.log").read_text()
    assert "DP-SGD epsilon" in log and "differential privacy (sample level" in log
    assert "per-example loop" not in log  # FS-LLM's trainer on a LoRA Llama: the batched taps served every step


SAMPLE = {"fedpa.dp.mode": "sample", "fedpa.dp.clip": 1.0, "fedpa.dp.noise_multiplier": 1.5,
          "federate.total_round_num": 2}  # fmt: skip


def test_a_client_whose_own_config_trains_more_is_refused_and_its_spend_is_the_ledgers(tiny_llm, tmp_path):
    """Distributed, client 1's own yaml trains 3x the server's local steps. Before, the ledger stated the server's
    plan (a red team: the client's log said epsilon 28.05, the ledger 16.1). Now the client reports its account,
    the server refuses its upload naming it (private faults file) and the ledger states what the client spent."""
    from tests.integration.test_distributed_fs import distributed_cfgs, run_distributed

    base = fedpa_cfg(tiny_llm, tmp_path, **SAMPLE, **{"federate.save_to": "", "fedpa.net.round_timeout_s": 60.0})
    cfgs = distributed_cfgs(base, tmp_path / "dist")
    steps = base["train"]["local_update_steps"]
    cfgs[1]["train"]["local_update_steps"] = 3 * steps
    assert run_distributed(cfgs, tmp_path) == 0
    server, client1 = outdir_of(cfgs[0]), outdir_of(cfgs[1])
    own = _jsonl(client1 / "fedpa_client_privacy.jsonl")[-1]
    entry = _jsonl(server / "fedpa_privacy.jsonl")[-1]["dp_clients"]["1"]
    assert own["steps"] == 2 * 3 * steps and (entry["source"], entry["steps"]) == ("client", own["steps"])
    # the client's figure, computed independently by dp-accounting (the stats crossed the wire as float32)
    assert entry["epsilon"] == pytest.approx(own["epsilon"], rel=1e-12)
    assert entry["epsilon"] == pytest.approx(_expected_epsilon(own["n"], own["b"], 1.5, 6 * steps, own["delta"]),
                                             rel=1e-9)  # fmt: skip
    faults = _jsonl(server / "fedpa_dp_faults.jsonl")
    assert {f["client"] for f in faults} == {"1"} and "disagrees with the server's plan" in faults[0]["reason"]
    records = _jsonl(server / "fedpa_diagnostics.jsonl")
    assert all("1" in r["dropped"] and not {"2", "3"} & set(r["dropped"]) for r in records)


def test_a_client_that_misreports_its_size_is_refused_and_credited_what_it_spent(tiny_llm, tmp_path):
    """Before: a client training on its n_i records but reporting 10^6 was credited the epsilon of 10^6 records
    (2.2 where its own log said 16.1), at full weight. Now its upload is refused, and the ledger keeps the n_i of
    its own account."""
    from tests.conftest import ROOT
    from tests.integration.tiny_assets import dump_yaml, fs_env, run_module

    cfg = fedpa_cfg(tiny_llm, tmp_path, **SAMPLE)
    proc = run_module("tests.integration.careless_client",
                      [dump_yaml(cfg, tmp_path / "careless.yaml"), "misreported size", "2", "1"], ROOT, fs_env(), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = outdir_of(cfg)
    entry = _jsonl(out / "fedpa_privacy.jsonl")[-1]["dp_clients"]["2"]
    own = [r for r in _jsonl(out / "fedpa_client_privacy.jsonl") if r["client"] == 2][-1]
    # its entry is what it spent: the n_i its own account gave (the ledger keeps it, not the reported 10^6)
    assert (entry["epsilon"], entry["n"]) == (own["epsilon"], own["n"]) and own["n"] < 100
    faults = _jsonl(out / "fedpa_dp_faults.jsonl")
    assert [(f["round"], f["client"]) for f in faults] == [(1, "2")] and "dp_n" in faults[0]["reason"]


def test_an_upload_without_its_size_is_refused_naming_the_client_and_the_run_goes_on(tiny_llm, tmp_path):
    """Issue 88: an upload that omits num_train_data killed the server in admit (a TypeError: it read the size before
    checking it), and the honest clients waited out their timeout. Now that client's upload is refused with a reason
    naming the key, the round aggregates the others, and the run ends normally."""
    from tests.conftest import ROOT
    from tests.integration.tiny_assets import dump_yaml, fs_env, run_module

    cfg = fedpa_cfg(tiny_llm, tmp_path, **SAMPLE)
    proc = run_module("tests.integration.careless_client",
                      [dump_yaml(cfg, tmp_path / "careless.yaml"), "no size", "2", "1"], ROOT, fs_env(), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    faults = _jsonl(outdir_of(cfg) / "fedpa_dp_faults.jsonl")
    assert [(f["round"], f["client"]) for f in faults] == [(1, "2")] and "num_train_data" in faults[0]["reason"]


@pytest.mark.parametrize(
    ("kind", "rnd", "overrides", "field"),
    [
        ("absurd steps", 1, {"fedpa.dp.accountant": "pld"}, "dp_steps"),  # the PLD accountant asked for 5e8 GiB
        ("absurd n", 0, {"fedpa.dp.delta": 1e-5}, "dp_n"),  # above 1/(10 n): the plan of 10^6 records raised
        ("without dp", 1, {}, "without DP-SGD"),  # the ledger credited the plan's epsilon 6.52
    ],
)
def test_an_account_no_dp_sgd_gives_is_refused_and_states_no_guarantee(tiny_llm, tmp_path, kind, rnd, overrides,
                                                                       field):  # fmt: skip
    """Issue 88: client 2's account of 10^15 steps (PLD) or of 10^6 records at delta 1e-5 raised in the
    server and ended the run; an upload without an account (a client whose own config says fedpa.dp.mode none) was
    dropped, but the ledger credited the client the plan's epsilon and the last line stated it. Now the upload is
    refused naming the client and the field, the run ends normally, the ledger states no guarantee for client 2
    (epsilon null) and the last line states no finite epsilon for it."""
    from tests.conftest import ROOT
    from tests.integration.tiny_assets import dump_yaml, fs_env, run_module

    cfg = fedpa_cfg(tiny_llm, tmp_path, **SAMPLE, **overrides)
    argv = [dump_yaml(cfg, tmp_path / "careless.yaml"), kind, "2", str(rnd)]
    proc = run_module("tests.integration.careless_client", argv, ROOT, fs_env(), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = outdir_of(cfg)
    faults = _jsonl(out / "fedpa_dp_faults.jsonl")
    assert [(f["round"], f["client"]) for f in faults] == [(rnd, "2")] and field in faults[0]["reason"]
    last = _jsonl(out / "fedpa_privacy.jsonl")[-1]
    assert last["dp_clients"]["2"]["guarantee"] == "none" and last["dp_clients"]["2"]["epsilon"] is None
    assert last["dp_epsilon"] is None and last["dp_no_guarantee"] == ["2"]
    assert all(last["dp_clients"][c]["epsilon"] < 100 for c in ("1", "3"))
    assert "no guarantee for client 2" in (out / "exp_print.log").read_text()  # the run's last line on privacy


def test_sample_level_poisson_sampling_with_the_pld_accountant(tiny_llm, tmp_path):
    """fedpa.dp.sampling poisson, fedpa.dp.accountant pld, z calibrated for epsilon 8: the ledger names the sampling,
    the add/remove adjacency and the accountant, each client's epsilon is dp-accounting's PLD of the Poisson
    subsampled Gaussian composed over its steps, and its z is below what rdp with fixed-size sampling needs."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    from fs_fedpa.privacy.accountant import calibrate

    overrides = {"fedpa.dp.mode": "sample", "fedpa.dp.clip": 1.0, "fedpa.dp.epsilon": 8.0,
                 "federate.total_round_num": 1, "fedpa.dp.sampling": "poisson", "fedpa.dp.accountant": "pld",
                 "fedpa.dp.seed": 5}  # fmt: skip
    out = _finished(fedpa_cfg(tiny_llm, tmp_path, **overrides), tmp_path)
    line = _jsonl(out / "fedpa_privacy.jsonl")[-1]
    assert line["dp_sampling"] == "poisson" and line["dp_adjacency"] == "add_remove"
    assert line["dp_accountant"].startswith("pld, dp-accounting") and line["dp_sensitivity"] == 1.0
    for entry in line["dp_clients"].values():
        n, b, z, steps = entry["n"], entry["b"], entry["noise_multiplier"], entry["steps"]
        event = pld.from_gaussian_mechanism(z, sensitivity=1.0, sampling_prob=b / n, value_discretization_interval=1e-3)
        assert entry["epsilon"] == pytest.approx(event.self_compose(steps).get_epsilon_for_delta(entry["delta"]),
                                                 rel=1e-9)  # fmt: skip
        assert entry["epsilon"] <= 8.0
        assert z < calibrate(n, b, steps, 8.0, entry["delta"], "wor", "rdp")
    assert "poisson sampling, pld" in (out / "exp_print.log").read_text()


def test_client_level_poisson_sampling_survives_a_round_that_draws_no_client(tiny_llm, tmp_path):
    """Each of 3 clients in at rate 1/3: some rounds draw two, some none. A round with none releases its noise
    alone and the run goes on; every round is one event of the Poisson subsampled Gaussian (add/remove, z)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    overrides = {"federate.client_num": 3, "federate.sample_client_num": 1, "federate.total_round_num": 6,
                 "fedpa.dp.mode": "client", "fedpa.dp.clip": 0.05, "fedpa.dp.noise_multiplier": 1.2,
                 "fedpa.dp.sampling": "poisson", "fedpa.dp.seed": 1}  # fmt: skip
    out = _finished(fedpa_cfg(tiny_llm, tmp_path, **overrides), tmp_path)
    ledger = _jsonl(out / "fedpa_privacy.jsonl")
    assert [line["dp_events"] for line in ledger] == [1, 2, 3, 4, 5, 6]
    records = _jsonl(out / "fedpa_diagnostics.jsonl")
    drawn = [len(r["clients"]) for r in records]
    assert 0 in drawn and max(drawn) >= 2, drawn  # this seed draws an empty round and a round of more than K
    assert "the draw sampled no client; the round aggregates without uploads" in (out / "exp_print.log").read_text()
    for t, line in enumerate(ledger, 1):
        accountant = rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
        accountant.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(1 / 3, dpa.GaussianDpEvent(1.2)), t))
        assert line["dp_epsilon"] == pytest.approx(accountant.get_epsilon(line["dp_delta"]), rel=1e-9)
        assert line["dp_sampling"] == "poisson" and line["dp_adjacency"] == "add_remove"
        assert line["dp_sensitivity"] == pytest.approx(0.05)


def _mean(tensors):
    return sum(t.double() for t in tensors) / len(tensors)


# fedit and fedsa_lora take the factor-change path that ffa_lora and fedsvd already test: opt-in (CI time)
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "method",
    ["fedpa", pytest.param("fedit", marks=SLOW), "ffa_lora", pytest.param("fedsa_lora", marks=SLOW), "fedsvd"],
)
def test_each_supported_method_runs_its_server_step_on_the_unweighted_mean(tiny_llm, tmp_path, method):
    """With a clip no update reaches and noise far below the float floor, the DP release is the plain mean over the
    fixed K = N (weights 1/K, not FS's sample counts), and the method's server step is applied to it."""
    from tests.integration.conftest import probe

    overrides = {
        "federate.method": method,
        "federate.total_round_num": 2,
        "fedpa.dp.mode": "client",
        "fedpa.dp.clip": 1e6,
        "fedpa.dp.noise_multiplier": 1e-12,
    }
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **overrides), tmp_path)
    for agg in run["aggregate"]:
        uploads, new = agg["uploads"], agg["global"]
        for name, (B_g, A_g) in new.items():
            Bs, As = [u[name][0] for u in uploads], [u[name][1] for u in uploads]
            if method == "fedpa":  # the rank-R_g truncated SVD of the mean product (dense reference)
                mean = _mean([B.double() @ A.double() for B, A in zip(Bs, As)])
                U, S, Vh = torch.linalg.svd(mean)
                R = B_g.shape[1]
                expected = (U[:, :R] * S[:R]) @ Vh[:R]
                torch.testing.assert_close(B_g.double() @ A_g.double(), expected, atol=1e-5, rtol=1e-4)
            elif method == "fedsvd":
                torch.testing.assert_close(B_g.double() @ A_g.double(), _mean(Bs) @ As[0].double(), atol=1e-5,
                                           rtol=1e-4)  # fmt: skip
                torch.testing.assert_close(A_g.double() @ A_g.double().T, torch.eye(A_g.shape[0], dtype=torch.float64),
                                           atol=1e-5, rtol=0)  # fmt: skip
            else:
                parts = {"fedit": "BA", "ffa_lora": "B", "fedsa_lora": "A"}[method]
                for part, mine, theirs in (("B", B_g, Bs), ("A", A_g, As)):
                    expected = _mean(theirs) if part in parts else theirs[0].double()  # unsent: the global, kept
                    torch.testing.assert_close(mine.double(), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["fedit", "fedpa"])
def test_client_level_clips_and_releases_a_federated_head_with_the_lora_update(tiny_glue, tmp_path, method):
    """A classifier head averaged by the server (not in personalization.local_param): each client's head change is
    clipped with its LoRA update as one contribution, and the server releases the start head plus the mean clipped
    change over K. With noise below the float floor and a clip that binds, the new head is that mean, computed here
    from the uploads (an independent computation of the joint clip: dense products for FedPA-LoRA)."""
    from tests.integration.conftest import probe
    from tests.integration.tiny_assets import fs_glue_yaml

    C = 0.05
    cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"], **{
        "federate.method": method, "personalization.local_param": [], "fedpa.dp.mode": "client", "fedpa.dp.clip": C,
        "fedpa.dp.noise_multiplier": 1e-12, "federate.total_round_num": 2})  # fmt: skip
    run = probe(cfg, tmp_path)
    assert any("classifier" in k for k in run["aggregate"][0]["shared_start"])
    for agg in run["aggregate"]:
        start, sent, K = agg["shared_start"], agg["global_start"], len(agg["uploads"])
        expected = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in start.items()}
        clipped = 0
        for factors, heads in zip(agg["uploads"], agg["shared_uploads"]):
            change = {k: heads[k].double() - v.double() for k, v in start.items()}
            sq = sum(float(c.pow(2).sum()) for c in change.values())
            if method == "fedpa":  # the applied product s_i B_i A_i (the probe's uploads are applied factors)
                sq += sum(float((B.double() @ A.double()).pow(2).sum()) for B, A in factors.values())
            else:  # the change of B and A from the global factors the round sent
                sq += sum(float((B.double() - sent[n][0].double()).pow(2).sum() + (A.double() - sent[n][1].double()
                          ).pow(2).sum()) for n, (B, A) in factors.items())  # fmt: skip
            scale = min(1.0, C / sq**0.5)
            clipped += scale < 1.0
            for k in expected:
                expected[k] += scale * change[k] / K
        assert clipped  # the clip binds: the head's change was scaled with the LoRA update
        for k, v in start.items():
            torch.testing.assert_close(agg["shared"][k].double(), v.double() + expected[k], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["client", pytest.param("sample", marks=SLOW)])
def test_resume_restores_the_accountant_and_the_seeded_noise(tiny_llm, tmp_path, mode):
    """With fedpa.dp.seed, a run killed after round 2's resume point and resumed draws the noise and the samples
    the uninterrupted run drew: the same global adapter bit for bit, and a ledger that goes on from its counts."""
    from tests.integration.conftest import probe
    from tests.integration.test_reliability_fs import _kill_after_resume_point

    def cfg(name, **more):
        (tmp_path / name).mkdir()
        changes = {"federate.total_round_num": 4, "federate.sample_client_num": 2, "expname": name,
                   "federate.save_to": str(tmp_path / name / "ckpt" / "run.pt"), "fedpa.dp.mode": mode,
                   "fedpa.dp.clip": 0.05 if mode == "client" else 1.0, "fedpa.dp.noise_multiplier": 1.0,
                   "fedpa.dp.seed": 11}  # fmt: skip
        return fedpa_cfg(tiny_llm, tmp_path / name, **changes, **more)

    full = probe(cfg("full"), tmp_path / "full")
    point = _kill_after_resume_point(cfg("killed"), tmp_path / "killed", rnd=2)
    resumed = probe(cfg("resumed", **{"federate.restore_from": str(point)}), tmp_path / "resumed")
    for name, (B, A) in full["final"]["global"].items():
        assert torch.equal(B, resumed["final"]["global"][name][0]) and torch.equal(
            A, resumed["final"]["global"][name][1]
        )
    ledger_full = _jsonl(Path(full["final"]["outdir"]) / "fedpa_privacy.jsonl")
    ledger_resumed = _jsonl(Path(resumed["final"]["outdir"]) / "fedpa_privacy.jsonl")
    # the resumed run's ledger begins with the lines of the run it continues: one file states the run's epsilon
    assert [line["round"] for line in ledger_resumed] == [0, 1, 2, 3]
    assert ledger_resumed == ledger_full
    assert ledger_full[-1]["dp_epsilon"] > ledger_full[1]["dp_epsilon"] > 0


@pytest.mark.parametrize(
    "key,value,named",
    [("fedpa.dp.noise_multiplier", 2.0, "fedpa.dp.noise_multiplier: saved 1.0, now 2.0"),
     ("federate.sample_client_num", 3, "federate.sample_client_num: saved 2, now 3"),
     ("fedpa.dp.clip", 0.1, "fedpa.dp.clip: saved 0.05, now 0.1"),
     # before: a bare KeyError 'generator' (an unseeded point holds no noise stream to continue)
     ("fedpa.dp.seed", 5, "fedpa.dp.seed: saved -1, now 5")],
)  # fmt: skip
def test_a_resume_with_other_privacy_settings_is_refused_naming_the_key(tiny_llm, tmp_path, key, value, named):
    """Killed after round 2 of 4 and resumed with z (or K, or C) changed: before, the accountant recomputed the
    two released rounds at the new values, so the ledger's epsilon went down across the resume (z 1 -> 5: 3.67
    instead of 16.93). Now the resume stops before any round, naming what changed."""
    from tests.integration.test_reliability_fs import _kill_after_resume_point

    def cfg(name, **more):
        (tmp_path / name).mkdir()
        changes = {"federate.total_round_num": 4, "federate.sample_client_num": 2, "expname": name,
                   "federate.save_to": str(tmp_path / name / "ckpt" / "run.pt"), "fedpa.dp.mode": "client",
                   "fedpa.dp.clip": 0.05, "fedpa.dp.noise_multiplier": 1.0}  # fmt: skip
        return fedpa_cfg(tiny_llm, tmp_path / name, **{**changes, **more})

    point = _kill_after_resume_point(cfg("killed"), tmp_path / "killed", rnd=2)
    saved = torch.load(point, weights_only=True, map_location="cpu")["fedpa_resume"]["privacy"]
    assert saved["rounds"] == 2 and "generator" not in saved  # no dp_seed: the noise stream stays unrecoverable
    proc = run_fs(cfg("resumed", **{"federate.restore_from": str(point), key: value}), tmp_path / "resumed")
    assert proc.returncode != 0
    assert "was saved with other settings" in proc.stderr and named in proc.stderr, proc.stderr[-3000:]


def _killed_at_round_2(tiny_llm, tmp_path: Path, mode: str = "client", **more):
    """(resume point, cfg maker): a DP run of 4 rounds killed after round 2's resume point."""
    from tests.integration.test_reliability_fs import _kill_after_resume_point

    def cfg(name, **extra):
        (tmp_path / name).mkdir()
        changes = {"federate.total_round_num": 4, "federate.sample_client_num": 2, "expname": name,
                   "federate.save_to": str(tmp_path / name / "ckpt" / "run.pt"), "fedpa.dp.mode": mode,
                   "fedpa.dp.clip": 0.05, "fedpa.dp.noise_multiplier": 1.0, **more}  # fmt: skip
        return fedpa_cfg(tiny_llm, tmp_path / name, **{**changes, **extra})

    return _kill_after_resume_point(cfg("killed"), tmp_path / "killed", rnd=2), cfg


def test_a_sample_level_resume_with_other_dp_min_records_is_refused(tiny_llm, tmp_path):
    """Before: the resume reached the ledger, whose clients now sat out (0 steps a round), and stopped with a bare
    ZeroDivisionError. dp_min_records decides who spends at all, so it is compared like every accounting input."""
    point, cfg = _killed_at_round_2(tiny_llm, tmp_path, "sample")
    proc = run_fs(cfg("resumed", **{"federate.restore_from": str(point), "fedpa.dp.min_records": 10**6}),
                  tmp_path / "resumed")  # fmt: skip
    assert proc.returncode != 0 and "ZeroDivisionError" not in proc.stderr
    assert "fedpa.dp.min_records: saved 0, now 1000000" in proc.stderr, proc.stderr[-3000:]


def test_a_resume_whose_clients_hold_other_data_is_refused_at_start(tiny_llm, tmp_path):
    """The accounting of a client's past steps used its n_i then; resumed on a data file of 1.5x the records, each
    client's n_i changes. Before (issue 88): the resume was taken, every later upload was refused, the run trained
    nothing and exited 0, and each client's own privacy file stated 6.89 where 14.18 was spent. Now the resume is
    refused before any round, naming the client's file and both sizes (its files record its n_i)."""
    from fs_fedpa.record import CLIENT_PRIVACY_FILE

    point, cfg = _killed_at_round_2(tiny_llm, tmp_path, "sample", **{"fedpa.dp.clip": 1.0})
    lines = Path(tiny_llm["data"]).read_text().splitlines()
    bigger = tmp_path / "bigger.jsonl"
    bigger.write_text("\n".join(lines + lines[: len(lines) // 2]) + "\n")
    resumed = cfg("resumed", **{"federate.restore_from": str(point)})
    resumed["data"]["type"] = f"{bigger}@llm"
    proc = run_fs(resumed, tmp_path / "resumed")
    sizes = torch.load(point, weights_only=True, map_location="cpu")["fedpa_resume"]["privacy"]["sizes"]
    assert proc.returncode != 0 and "Starting training" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert str(point) in proc.stderr and "but the client's training set now has" in proc.stderr, proc.stderr[-3000:]
    assert any(f"field 'data.n' is {n}," in proc.stderr for n in sizes.values()), proc.stderr[-3000:]
    assert not (outdir_of(resumed) / CLIENT_PRIVACY_FILE).exists()  # no client stated anything


def _rewrite(point: Path, change) -> None:
    saved = torch.load(point, weights_only=True, map_location="cpu")
    change(saved["fedpa_resume"])
    torch.save(saved, point)


@pytest.mark.parametrize(
    "field,named",
    [("settings", "has no field 'settings'"),  # before: compared against nothing, and resumed
     ("privacy", "has no field 'privacy'"),  # before: trusted, the accountant restarting at 0 releases
     ("privacy.rounds", "field 'privacy.rounds' is missing"),
     ("settings.fedpa.dp.clip", "fedpa.dp.clip: saved 'nothing', now 0.05")],
)  # fmt: skip
def test_a_resume_point_missing_what_the_accountant_reads_is_refused(tiny_llm, tmp_path, field, named):
    point, cfg = _killed_at_round_2(tiny_llm, tmp_path)

    def drop(saved: dict) -> None:
        head, _, rest = field.partition(".")
        if rest:
            del saved[head][rest]
        else:
            del saved[head]

    _rewrite(point, drop)
    proc = run_fs(cfg("resumed", **{"federate.restore_from": str(point)}), tmp_path / "resumed")
    assert proc.returncode != 0 and str(point) in proc.stderr, proc.stderr[-3000:]
    assert named in proc.stderr and "Traceback" not in proc.stderr.split("ValueError")[-1], proc.stderr[-3000:]


@pytest.mark.parametrize("damage", ["garbage line", "a folder"])
def test_a_broken_ledger_is_refused_naming_it(tiny_llm, tmp_path, damage):
    """Before: a bare JSONDecodeError (a garbage line) or an IsADirectoryError naming no file."""
    import shutil

    point, cfg = _killed_at_round_2(tiny_llm, tmp_path)
    ledger = Path(torch.load(point, weights_only=True, map_location="cpu")["fedpa_resume"]["privacy"]["ledger"])
    if damage == "garbage line":
        ledger.write_text(ledger.read_text() + "{not json\n")
    else:
        shutil.rmtree(ledger, ignore_errors=True)
        ledger.unlink()
        ledger.mkdir()
    proc = run_fs(cfg("resumed", **{"federate.restore_from": str(point)}), tmp_path / "resumed")
    assert proc.returncode != 0 and f"the DP ledger {str(ledger)!r}" in proc.stderr, proc.stderr[-3000:]
    assert ("line 3 is not a ledger line" if damage == "garbage line" else "cannot be read") in proc.stderr


def test_a_release_after_the_last_resume_point_is_counted_when_the_run_resumes(tiny_llm, tmp_path):
    """The crash window: round 1's release leaves (its ledger line is written at aggregation) before round 2's resume
    point. Emulated exactly: the run goes on to round 2's resume point and is killed there, and round 1's resume
    point, kept aside when it was written, is put back, as if the run had died before writing round 2's. The resumed
    run releases round 1 again with fresh noise: 2 + 3 = 5 releases in all, and its final epsilon is dp-accounting's
    for 5 events (before: 1 + 3 = 4, from the resume point's count)."""
    import shutil
    import subprocess
    import sys

    from tests.integration.tiny_assets import dump_yaml, fs_env

    def cfg(name, **more):
        (tmp_path / name).mkdir()
        changes = {"federate.total_round_num": 4, "federate.sample_client_num": 2, "expname": name,
                   "federate.save_to": str(tmp_path / "ckpt" / "run.pt"), "fedpa.dp.mode": "client",
                   "fedpa.dp.clip": 0.05, "fedpa.dp.noise_multiplier": 1.0}  # fmt: skip
        return fedpa_cfg(tiny_llm, tmp_path / name, **{**changes, **more})

    killed = cfg("killed")
    point = tmp_path / "ckpt" / "fedpa_resume_run.pt"
    proc = subprocess.Popen([sys.executable, "-m", "federatedscope.main", "--cfg",
                             dump_yaml(killed, tmp_path / "killed" / "killed.yaml")], cwd=tmp_path / "killed",
                            env=fs_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        for line in proc.stdout:
            if "resume point for round 1 written to" in line:
                shutil.copy(point, tmp_path / "round1.pt")
            if "resume point for round 2 written to" in line:
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    ledger_killed = _jsonl(outdir_of(killed) / "fedpa_privacy.jsonl")
    assert [line["round"] for line in ledger_killed] == [0, 1]  # rounds 0 and 1 were released
    shutil.copy(tmp_path / "round1.pt", point)  # the run "died" before round 2's resume point
    resumed = cfg("resumed", **{"federate.restore_from": str(point)})
    out = _finished(resumed, tmp_path / "resumed")
    ledger = _jsonl(out / "fedpa_privacy.jsonl")
    assert ledger[:2] == ledger_killed  # the continued run's lines first
    assert [line["round"] for line in ledger[2:]] == [1, 2, 3] and ledger[-1]["dp_events"] == 5
    delta = min(1e-5, 1 / (10 * 3))
    assert ledger[-1]["dp_epsilon"] == pytest.approx(_expected_epsilon(3, 2, 1.0, 5, delta), rel=1e-9)
    assert ledger[-1]["dp_epsilon"] > _expected_epsilon(3, 2, 1.0, 4, delta)


@pytest.mark.parametrize("method", ["fedit", pytest.param("ffa_lora", marks=SLOW)])
def test_change_norm_is_the_norm_of_the_uploaded_change(tiny_llm, tmp_path, method):
    """The diagnostic client-level DP's clip is chosen from (no DP here): ||X_i - X_g|| over the uploaded factors,
    from the global factors the client started from, against the probe's completed uploads and previous global."""
    from tests.integration.conftest import probe

    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": method, "federate.total_round_num": 2}), tmp_path)
    records = {r["round"]: r for r in _jsonl(Path(run["final"]["outdir"]) / "fedpa_diagnostics.jsonl")}
    previous = run["aggregate"][0]["global"]  # what every client of round 1 started from
    agg = run["aggregate"][1]
    parts = (0, 1) if method == "fedit" else (0,)
    for client, upload in zip(agg["clients"], agg["uploads"]):
        sq = sum(float((upload[n][i].double() - previous[n][i].double()).pow(2).sum()) for n in upload for i in parts)
        assert records[1]["change_norm"][str(client)] == pytest.approx(sq**0.5, rel=1e-5)


def test_sample_level_dp_sgd_trains_the_glue_classifier(tiny_glue, tmp_path):
    """DP-SGD through the plugin's seqcls trainer (dict batches, local heads), the protocol's DP cells' path."""
    from tests.integration.tiny_assets import fs_glue_yaml

    cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"], **{
        "fedpa.dp.mode": "sample", "fedpa.dp.clip": 1.0, "fedpa.dp.epsilon": 8.0, "fedpa.dp.horizon": 5,
        "fedpa.dp.seed": 5})  # fmt: skip
    out = _finished(cfg, tmp_path)
    # with a seed, sample mode warns too (before, it said nothing): the guarantee assumes the seed is secret
    assert "holds only while the seed stays secret" in (out / "exp_print.log").read_text()
    ledger = _jsonl(out / "fedpa_privacy.jsonl")
    entries = ledger[-1]["dp_clients"].values()
    assert len(ledger) == 2 and all(e["steps"] == 8 and e["b"] == min(8, e["n"]) for e in entries)
    assert "per-example loop" not in (out / "exp_print.log").read_text()  # the batched taps served every step
    assert all(e["epsilon"] < 8.0 for e in entries)  # 2 of the 5 rounds the noise was calibrated for


def test_client_level_messages_time_stamp_the_sample_count_they_carry():
    """Under client-level DP a client's message carries 1 as its sample count, and FS's time model (comp_cost = 3 x
    count x comp_speed) must be fed the same 1: fed the true count, the timestamp would carry the client's size.
    FedPAClient's own training callback on a stand-in for the rest of the client (FS's _gen_timestamp is real)."""
    from types import SimpleNamespace

    from federatedscope.core.message import Message
    from federatedscope.core.workers.client import Client

    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.plugin.client import FedPAClient
    from fs_fedpa.privacy import client_policy
    from fs_fedpa.systems import TrainCounter

    sent = []
    cfg = SimpleNamespace(llm=SimpleNamespace(deepspeed=SimpleNamespace(use=False)))
    fake = SimpleNamespace(ID=2, state=0, comp_speed=0.5, comm_bandwidth=4.0, model_size=8.0, schedule=None,
                           kept=SimpleNamespace(rounds_trained=1, unpark=lambda *a: None), _cfg=cfg,
                           client_model=SimpleNamespace(initial_factors=None, device="cpu"),
                           round=SimpleNamespace(enter=lambda *a: None, leave=lambda *a: {"lora": {}}),
                           counter=TrainCounter(),
                           outbox=SimpleNamespace(answering=lambda *a: None),
                           resume=SimpleNamespace(restore=lambda *a: None),
                           method=SimpleNamespace(cfg=FedPAConfig(dp={"mode": "client", "clip": 1.0,
                                                                      "noise_multiplier": 1.0})),
                           trainer=SimpleNamespace(train=lambda: (57, None, {}), ctx=SimpleNamespace()),
                           _monitor=SimpleNamespace(format_eval_res=lambda *a, **k: ""),
                           comm_manager=SimpleNamespace(send=sent.append))  # fmt: skip
    for name in ("_unpark", "_park"):
        setattr(fake, name, lambda *a, **k: None)
    fake._open = lambda message: FedPAClient._open(fake, message)
    fake._gen_timestamp = lambda **kw: Client._gen_timestamp(fake, **kw)
    fake.privacy = client_policy(cfg, fake.method, fake.trainer, [])
    FedPAClient.callback_funcs_for_model_para(fake, Message(msg_type="model_para", sender=0, receiver=[2], state=0,
                                                             timestamp=10.0, content={}))  # fmt: skip
    (message,) = sent
    assert message.content[0] == 1
    assert message.timestamp == pytest.approx(10.0 + 3.0 * 1 * 0.5 + 2.0 * 8.0 / 4.0)  # not 3 x 57 x 0.5


def test_clients_below_dp_min_records_take_no_step_and_spend_nothing(tiny_llm, tmp_path):
    """fedpa.dp.min_records above every client's size: no client takes a DP-SGD step (the plan's 0 steps would
    stop one that did), each ledger entry is epsilon 0 after 0 steps, the run completes and the global adapter stays
    where it started: an upload without a step is not aggregated (issue 88: a round of only such uploads used to
    weigh them equally, and installed their factors as the global), and such a round is not a failed one."""
    overrides = {"fedpa.dp.mode": "sample", "fedpa.dp.clip": 1.0, "fedpa.dp.noise_multiplier": 1.0,
                 "fedpa.dp.min_records": 10**6, "federate.total_round_num": 2}  # fmt: skip
    out = _finished(fedpa_cfg(tiny_llm, tmp_path, **overrides), tmp_path)
    last = _jsonl(out / "fedpa_privacy.jsonl")[-1]
    assert last["dp_epsilon"] == 0.0 and len(last["dp_clients"]) == 3
    assert all(e["steps"] == 0 and e["epsilon"] == 0.0 for e in last["dp_clients"].values())
    assert "fewer than fedpa.dp.min_records(=1000000): it takes no DP-SGD step" in (out / "exp_print.log").read_text()
    own = _jsonl(out / "fedpa_client_privacy.jsonl")  # each client's own account: nothing spent, every round
    assert len(own) == 6 and all(r["sits_out"] and r["steps"] == 0 and r["epsilon"] == 0.0 for r in own)
    records = _jsonl(out / "fedpa_diagnostics.jsonl")
    assert all(r["clients"] == [] and sorted(r["dropped"]) == ["1", "2", "3"] for r in records)
    assert all("no DP-SGD step" in reason for r in records for reason in r["dropped"].values())
    assert "every upload was set aside (took no DP-SGD step" in (out / "exp_print.log").read_text()


def test_the_label_prior_key_parses_beside_the_studys_flat_keys_and_needs_a_sequence_classifier():
    """research/study/sst2_dp_fedpa.py's var_prior overrides (old flat fedpa.dp_* keys beside fedpa.dp.label_prior)
    on the study's FS config; the key is refused, naming it, on a trainer that is not seqcls."""
    from federatedscope.core.configs.config import global_cfg

    from research.study import sst2_dp_fedpa as study
    from research.study import sst2_protocol as sp

    run = next(r for r in study.variants(1.0) if r.name == "var_prior")
    cfg = global_cfg.clone()
    cfg.merge_from_file(str(sp.CFG_NAME))
    cfg.merge_from_list([*run.opts, "federate.method", run.method])
    assert cfg.fedpa.dp.label_prior == study.PRIOR_SIGMA and cfg.fedpa.dp.mode == "sample"
    assert cfg.fedpa.dp.epsilon == 8.0 and cfg.fedpa.dp.local_tensors == "frozen"
    with pytest.raises(ValueError, match=r"fedpa.dp.label_prior needs a sequence classifier \(trainer.type seqcls\)"):
        global_cfg.clone().merge_from_list([*run.opts, "federate.method", run.method, "trainer.type", "general"])


PRIOR = 4.0


def _label_prior_cfg(tiny_glue, tmp_path: Path, name: str, **more) -> dict:
    from tests.integration.tiny_assets import fs_glue_yaml

    (tmp_path / name).mkdir()
    return fs_glue_yaml(tmp_path / name, tiny_glue["model"], tiny_glue["glue"], **{
        "federate.total_round_num": 3, "federate.save_to": str(tmp_path / name / "ckpt" / "run.pt"),
        "fedpa.dp.mode": "sample", "fedpa.dp.clip": 1.0, "fedpa.dp.epsilon": 8.0, "fedpa.dp.seed": 5,
        "fedpa.dp.label_prior": PRIOR, **more})  # fmt: skip


def _client_biases(ckpt: Path) -> dict[int, dict[int, torch.Tensor]]:
    """client -> round -> the b its resume file holds."""
    from fs_fedpa import resume

    out = {}
    for client in (1, 2, 3):
        for rnd, path in resume.client_files(resume.server_path(str(ckpt / "run.pt")), client).items():
            saved = torch.load(path, weights_only=True, map_location="cpu")
            out.setdefault(client, {})[rnd] = saved["privacy"]["label_prior"]
    return out


@SLOW
def test_label_prior_through_fs_composes_on_the_ledger_and_resumes_with_the_same_bias(tiny_glue, tmp_path):
    """fedpa.dp.label_prior on the tiny GLUE run: every stepping client holds b = log pi^ (a distribution over the 2
    labels) in its resume files; the ledger's epsilon per client is dp-accounting's composition of the count
    (Gaussian(sigma / sqrt 2), replace-one) with the steps, at most the target and above the steps alone; a run
    killed after round 2 whose clients' b is replaced in their files goes on with that b (loaded, not drawn again)."""
    import math

    from dp_accounting.rdp import rdp_privacy_accountant

    from tests.integration.test_reliability_fs import _kill_after_resume_point

    out = _finished(_label_prior_cfg(tiny_glue, tmp_path, "full"), tmp_path / "full")
    ledger = _jsonl(out / "fedpa_privacy.jsonl")
    entries = ledger[-1]["dp_clients"]
    assert len(entries) == 3
    for entry in entries.values():
        assert entry["prior_sigma"] == PRIOR and entry["steps"] > 0
        relation = dpa.NeighboringRelation.REPLACE_ONE
        step = dpa.SampledWithoutReplacementDpEvent(entry["n"], entry["b"],
                                                    dpa.GaussianDpEvent(entry["noise_multiplier"] / 2))  # fmt: skip
        steps = dpa.SelfComposedDpEvent(step, entry["steps"])
        both = dpa.ComposedDpEvent([dpa.GaussianDpEvent(PRIOR / math.sqrt(2)), steps])
        expected = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation).compose(both)
        alone = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation).compose(steps)
        assert entry["epsilon"] == pytest.approx(expected.get_epsilon(entry["delta"]), rel=1e-6)
        assert alone.get_epsilon(entry["delta"]) < entry["epsilon"] <= 8.0
    lines = [line for line in _jsonl(out / "fedpa_client_privacy.jsonl") if not line.get("sits_out")]
    assert lines and all(line["prior_sigma"] == PRIOR for line in lines)
    biases = _client_biases(tmp_path / "full" / "ckpt")
    assert set(biases) == {1, 2, 3}
    for per_round in biases.values():
        first, *rest = per_round.values()
        assert first.shape == (2,) and float(first.exp().sum()) == pytest.approx(1.0, rel=1e-5)
        assert all(torch.equal(first, b) for b in rest)  # drawn once
    point = _kill_after_resume_point(_label_prior_cfg(tiny_glue, tmp_path, "killed"), tmp_path / "killed", rnd=2)
    planted = torch.log(torch.tensor([0.875, 0.125]))
    for client in (1, 2, 3):
        from fs_fedpa import resume

        for path in resume.client_files(str(point), client).values():
            saved = torch.load(path, weights_only=True, map_location="cpu")
            saved["privacy"]["label_prior"] = planted.clone()
            torch.save(saved, path)
    _finished(_label_prior_cfg(tiny_glue, tmp_path, "resumed", **{"federate.restore_from": str(point)}),
              tmp_path / "resumed")  # fmt: skip
    resumed = _client_biases(tmp_path / "resumed" / "ckpt")
    assert resumed and all(torch.equal(b, planted) for per_round in resumed.values() for b in per_round.values())
