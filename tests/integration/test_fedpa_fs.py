"""FedPA-LoRA selected by name in stock FederatedScope-LLM, on a tiny random Llama and synthetic data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import fedpa_cfg, probe
from tests.integration.tiny_assets import dump_yaml, fs_env, outdir_of, read_eval_results, run_fs

pytestmark = pytest.mark.integration


def _product(factors):
    return {n: B.double() @ A.double() for n, (B, A) in factors.items()}


def _dense_optimum(Bs, As, weights, rank):
    """Independent reference: SVD of the dense weighted aggregate, truncated to ``rank``."""
    total = sum(weights)
    X = sum(w / total * (B.double() @ A.double()) for w, B, A in zip(weights, Bs, As))
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    return (U[:, :rank] * S[:rank]) @ Vh[:rank]


def _diagnostics(outdir):
    with open(Path(outdir) / "fedpa_diagnostics.jsonl") as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------ FS's own entry points


def test_main_py_runs_fedpa_and_writes_one_diagnostics_record_per_round(tiny_llm, tmp_path):
    # Prepare: FS's main.py as a file, exactly as `python federatedscope/main.py --cfg X` from a checkout
    import federatedscope

    cfg = fedpa_cfg(tiny_llm, tmp_path)
    main_py = Path(federatedscope.__file__).parent / "main.py"
    cfg_file = dump_yaml(cfg, tmp_path / "fedpa.yaml")
    # Execute
    proc = subprocess.run(
        [sys.executable, str(main_py), "--cfg", cfg_file, "fedpa.lam", "2.0"],
        cwd=tmp_path,
        env=fs_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    # Assert
    assert proc.returncode == 0, proc.stderr[-4000:]
    outdir = outdir_of(cfg)
    records = _diagnostics(outdir)
    assert [r["round"] for r in records] == [0, 1, 2]
    assert all(r["method"] == "fedpa" and r["lam"] == {"1": 2.0, "2": 2.0, "3": 2.0} for r in records)
    assert {"e_agg", "spectrum_probe", "alignment_loss", "bytes_up", "bytes_down", "bytes_up_total"} <= set(records[0])
    rounds = [row for row in read_eval_results(outdir) if "Results_weighted_avg" in row]
    assert rounds and "local.test_loss" in rounds[-1]["Results_weighted_avg"]


def test_module_entry_point_accepts_cli_overrides(tiny_llm, tmp_path):
    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"federate.total_round_num": 1})
    proc = run_fs(cfg, tmp_path, extra_opts=["fedpa.svd", "randomized", "fedpa.oversample", "2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _diagnostics(outdir_of(cfg))[0]["svd"] == "randomized"


def test_fedpa_yaml_fails_loudly_without_the_plugin(tiny_llm, tmp_path):
    # Prepare: `python -S` skips site processing, so fs_fedpa.pth never runs; PYTHONPATH still finds FS
    import site

    cfg = fedpa_cfg(tiny_llm, tmp_path)
    paths = os.pathsep.join(site.getsitepackages())
    # Execute
    proc = run_fs(cfg, tmp_path, python_args=["-S"], env={"PYTHONPATH": paths}, timeout=120)
    # Assert: the fedpa section is unknown to a plugin-less FS, instead of a silent FedAvg run
    assert proc.returncode != 0
    assert "Non-existent config key: fedpa" in proc.stderr or "Non-existent key: fedpa" in proc.stderr


# ------------------------------------------------------------------------ what the workers do


@pytest.fixture(scope="module")
def shared_run(tiny_llm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared")
    return probe(fedpa_cfg(tiny_llm, tmp), tmp)


@pytest.mark.parametrize("share_local_model", [True, False])
def test_clients_start_each_round_from_their_own_factors_bit_for_bit(
    tiny_llm, tmp_path, share_local_model, shared_run
):
    run = (
        shared_run
        if share_local_model
        else probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.share_local_model": False}), tmp_path)
    )
    ends = {(r["client"], r["round"]): r["end"] for r in run["leave"]}
    checked = 0
    for entry in run["enter"]:
        previous = ends.get((entry["client"], entry["round"] - 1))
        if previous is None:
            continue
        for name, (B, A) in entry["start"].items():
            assert torch.equal(B, previous[name][0]) and torch.equal(A, previous[name][1])
        checked += 1
    assert checked == 6  # 3 clients x rounds 1, 2


def test_server_global_is_the_dense_optimum_of_the_uploads(shared_run):
    for agg in shared_run["aggregate"]:
        for name, (B_g, A_g) in agg["global"].items():
            Bs = [u[name][0] for u in agg["uploads"]]
            As = [u[name][1] for u in agg["uploads"]]
            rank = B_g.shape[1]
            expected = _dense_optimum(Bs, As, agg["weights"], rank)
            got = B_g.double() @ A_g.double()
            assert torch.linalg.matrix_norm(got - expected) <= 1e-5 * (1 + torch.linalg.matrix_norm(expected))


def test_dense_and_reduced_runs_give_the_same_global_adapter(tiny_llm, tmp_path, shared_run):
    dense = probe(fedpa_cfg(tiny_llm, tmp_path, **{"fedpa.svd": "dense"}), tmp_path)
    reduced_products = _product(shared_run["final"]["global"])
    for name, P in _product(dense["final"]["global"]).items():
        assert torch.linalg.matrix_norm(P - reduced_products[name]) <= 1e-5 * (1 + torch.linalg.matrix_norm(P))


def test_no_client_keeps_its_last_optimizer(shared_run):
    """FS leaves each routine's optimizer (AdamW moments, and the round's factor parameters, 3x the adapter) on the
    trainer's context: kept by every client that ever trained, it grew with the clients sampled (issue 34)."""
    assert len(shared_run["leave"]) > 0 and shared_run["final"]["optimizers_kept"] == []


def test_no_client_holds_its_state_after_the_run(shared_run):
    """At the finish message each client reads its state back to save it; kept, every client's state would be in
    memory at once at the end of the run, whatever the budget (N = 1000 in bench_clients: 242 MiB; issue 34)."""
    final = shared_run["final"]
    assert final["finished"] == final["client_ids"] and len(final["clients"]) > 1
    assert final["held_after_finish"] == []


def test_clients_share_one_config_name_set_and_rank_plan(shared_run):
    """FS deep-copies the config for every client and each trainer builds a set of every parameter name; the method
    a rank plan with per-client tuples of length N: 117 KiB of FS's setup a client, 17 KiB shared (issue 34)."""
    assert len(shared_run["final"]["clients"]) > 1
    assert shared_run["final"]["distinct"] == {"config": 1, "trainer config": 1, "names": 1, "plan": 1}


def test_each_client_has_fs_own_model_size_from_one_pickle_of_the_shared_model(shared_run):
    """FS's Client.__init__ pickles the client's model to size it; with share_local_model the plugin sizes the one
    model once (fs_patches.sized_once), and every client still holds the size FS's own formula gives."""
    final = shared_run["final"]
    assert len(final["model_sizes"]) > 1 and final["model_sizes"] == final["model_size_fs"]
    assert all(size > 8 for size in final["model_sizes"].values())  # a real pickle's, not FS's fallback of 1.0


@pytest.mark.parametrize("level", ["light", "off"])
def test_light_or_no_diagnostics_compute_none_of_the_study_s_and_change_nothing_else(level, tiny_llm, tmp_path,
                                                                                    shared_run):
    """``fedpa.records.diagnostics light`` (the default) and ``off``: no E_agg on the server, no mechanism stats from
    the clients; ``light`` still writes each round's record with what a user reads (bytes, weights, the alignment
    term), ``off`` no file. The run itself (global factors, every client's factors and local tensors) is bit for bit
    the run with ``full`` diagnostics (``shared_run``)."""
    quiet = probe(fedpa_cfg(tiny_llm, tmp_path, **{"fedpa.records.diagnostics": level}), tmp_path)
    assert shared_run["e_agg_calls"] > 0 and quiet["e_agg_calls"] == 0
    written = Path(quiet["final"]["outdir"]) / "fedpa_diagnostics.jsonl"
    assert written.exists() == (level == "light")
    if level == "light":
        records = [json.loads(line) for line in written.read_text().splitlines()]
        assert len(records) == 3 and all(r["e_agg"] is None and r["spectrum_probe"] == [] for r in records)
        assert all(r["bytes_up_total"] > 0 and len(r["weights"]) == 3 and r["alignment_loss_mean"] > 0
                   for r in records[1:])  # fmt: skip
    costly = {"delta_norm", "drift", "drift_rel", "e_init_B", "e_init_A", "drift_start", "grad_ratio_first"}
    assert any(costly & set(s["stats"]) for s in shared_run["sent"])
    assert not any(costly & set(s["stats"]) for s in quiet["sent"])
    assert [s["stats"]["alignment_loss"] for s in quiet["sent"]] == [s["stats"]["alignment_loss"] for s in
                                                                     shared_run["sent"]]  # fmt: skip
    for part in ("global", "clients", "local"):
        assert _equal(quiet["final"][part], shared_run["final"][part]), part


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def test_penalty_changes_training_and_lambda_zero_trains_on_the_task_loss_alone(tiny_llm, tmp_path, shared_run):
    # Prepare / Execute
    plain = probe(fedpa_cfg(tiny_llm, tmp_path, **{"fedpa.lam": 0.0}), tmp_path)
    # Assert: with lam = 0 nothing is added to the loss; with lam > 0 a positive term is
    assert plain["loss_gap"] and all(gap == 0.0 for gap in plain["loss_gap"])
    assert any(gap > 0 for gap in shared_run["loss_gap"])
    # and the trained factors differ
    a, b = plain["final"]["clients"][1], shared_run["final"]["clients"][1]
    assert any(not torch.equal(a[n][0], b[n][0]) for n in a)


def test_heterogeneous_client_and_reference_ranks_and_two_conversions_a_round(tiny_llm, tmp_path):
    # with every diagnostic and resume files: nothing of a round converts factors but into and out of the model
    overrides = {"fedpa.client_ranks": [2, 4, 8], "fedpa.reference_ranks": [1, 2, 4],
                 "federate.save_to": str(tmp_path / "fedpa.ckpt")}  # fmt: skip
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **overrides), tmp_path)
    conversions = {(c["client"], c["round"]): c["n"] for c in run["conversions"]}
    assert len(conversions) == 9 and set(conversions.values()) == {2}, conversions
    upload_ranks = {r["client"]: r["upload_ranks"] for r in run["leave"]}
    assert upload_ranks == {1: [2], 2: [4], 3: [8]}
    received = {(r["client"], r["round"]): r["received_ranks"] for r in run["enter"] if r["round"] > 0}
    assert {c: ranks for (c, _), ranks in received.items()} == {1: [1], 2: [2], 3: [4]}
    assert {B.shape[1] for B, _ in run["final"]["global"].values()} == {4}  # R_g = max R_i
    records = _diagnostics(run["final"]["outdir"])
    assert records[-1]["bytes_down"]["1"] < records[-1]["bytes_down"]["3"]  # downlink cost grows with R_i


def test_clients_not_sampled_keep_their_factors(tiny_llm, tmp_path):
    # Prepare / Execute: 2 of 3 clients per round; every client is still evaluated every round
    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"federate.sample_client_num": 2, "federate.total_round_num": 4})
    run = probe(cfg, tmp_path)
    # Assert
    sampled = {agg["round"]: set(agg["clients"]) for agg in run["aggregate"]}
    assert all(len(c) == 2 for c in sampled.values())
    ends = {(r["client"], r["round"]): r["end"] for r in run["leave"]}
    idle_after_training = 0
    for client in (1, 2, 3):
        rounds = sorted(rnd for c, rnd in ends if c == client)
        if not rounds:
            continue
        last = ends[(client, rounds[-1])]
        # a later start (if any) and the final state both equal the factors of its last round
        for entry in run["enter"]:
            if entry["client"] == client and entry["round"] > rounds[0]:
                previous = ends[(client, max(r for r in rounds if r < entry["round"]))]
                assert all(torch.equal(entry["start"][n][0], previous[n][0]) for n in previous)
        final = run["final"]["clients"][client]
        assert all(torch.equal(final[n][0], last[n][0]) and torch.equal(final[n][1], last[n][1]) for n in last)
        idle_after_training += rounds[-1] < 3
    assert idle_after_training >= 1  # some client sat out the last round(s) after training


@pytest.mark.parametrize("local", [True, False])
def test_local_tensors_never_leave_the_client(tiny_llm, tmp_path, local):
    # Prepare: train the RMSNorm weights too (PEFT modules_to_save); local or shared by local_param
    args = [
        {
            "adapter_package": "peft",
            "adapter_method": "lora",
            "r": 4,
            "lora_alpha": 8,
            "lora_dropout": 0.0,
            "modules_to_save": ["norm"],
        }
    ]
    overrides = {"llm.adapter.args": args, "federate.total_round_num": 2}
    if local:
        overrides["personalization.local_param"] = ["norm"]
    # Execute
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **overrides), tmp_path)
    # Assert
    keys = [k for r in run["leave"] for k in r["upload_keys"]]
    has_norm = any("norm" in k for k in keys)
    assert has_norm is (not local)


def test_checkpoints_hold_the_global_adapter_and_every_clients_own_state(tiny_llm, tmp_path):
    # Prepare: heterogeneous ranks, best round chosen by the clients' own factors' val loss
    ckpt = tmp_path / "fedpa.ckpt"
    overrides = {
        "federate.save_to": str(ckpt),
        "fedpa.client_ranks": [2, 4, 8],
        "eval.best_res_update_round_wise_key": "local.val_loss",
    }
    # Execute
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **overrides), tmp_path)
    # Assert: the final server checkpoint carries the final global factors, FS's model state at rank R_g
    final = torch.load(tmp_path / "final_fedpa.ckpt", weights_only=False)
    assert final["fedpa"]["client_ranks"] == [2, 4, 8] and final["fedpa"]["R_g"] == 8
    for name, (B, A) in run["final"]["global"].items():
        assert torch.equal(final["fedpa"]["global"][name][0], B) and torch.equal(final["fedpa"]["global"][name][1], A)
    lora_B = [v for k, v in final["model"].items() if "lora_B" in k]
    assert lora_B and all(t.shape[1] == 8 for t in lora_B)
    # and each client's file its own final factors, of its own rank, applied: (s_i B_i, A_i) with s_i = 8 / r_i
    for client, rank in zip((1, 2, 3), (2, 4, 8)):
        state = torch.load(tmp_path / f"fedpa_client_{client}_fedpa.ckpt", weights_only=False)
        assert state["rank"] == rank and state["space"] == "applied"
        for name, (B, A) in run["final"]["clients"][client].items():
            assert torch.equal(state["factors"][name][0], (8 / rank) * B) and torch.equal(state["factors"][name][1], A)
            assert B.shape[1] == rank


def test_server_side_evaluation_uses_the_global_adapter(tiny_llm, tmp_path):
    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"federate.make_global_eval": True, "federate.total_round_num": 2})
    proc = run_fs(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in read_eval_results(outdir_of(cfg)) if "Results_raw" in r and r.get("Round") != "Final"]
    assert rows and "test_avg_loss" in rows[-1]["Results_raw"]


def test_every_yaml_config_loads_into_fs_with_the_plugin():
    from federatedscope.core.configs.config import global_cfg

    from fs_fedpa.plugin.config_fs import PLUGIN_METHODS

    configs = sorted((Path(__file__).resolve().parents[2] / "yaml_configs").rglob("*.yaml"))
    assert len(configs) > 90
    for path in configs:
        cfg = global_cfg.clone()
        cfg.merge_from_file(str(path))
        assert cfg.federate.method in PLUGIN_METHODS, path.name


def test_baseline_configs_differ_from_fedpa_only_in_method_and_learning_rate():
    """... and FedRot-LoRA's alignment strength, which is the paper's per-task value."""
    import yaml

    root = Path(__file__).resolve().parents[2] / "yaml_configs"

    def comparable(path):
        cfg = yaml.safe_load(path.read_text())
        for section, key in (("federate", "method"), ("federate", "save_to"), ("train", "optimizer")):
            cfg[section].pop(key, None)  # save_to: no shipped yaml names one (a run saves into its own folder)
        cfg.pop("expname")
        strength = cfg["fedpa"].pop("fedrot_lora", {}).get("strength")
        assert strength == (0.6 if path.name.startswith("fedrot_lora") else None), path.name  # SST-2's value
        if path.name.startswith(("fed_plora", "ravan")):  # every client receives all R modules / all heads
            assert cfg["fedpa"].pop("reference_ranks") == [16, 16, 16]
            cfg["fedpa"]["reference_ranks"] = [2, 4, 16]
        return cfg

    for path in sorted((root / "baselines").glob("*_sst2*.yaml")):
        fedpa = root / ("paper/fedpa_sst2_hetero.yaml" if "hetero" in path.name else "fedpa_sst2.yaml")
        assert comparable(path) == comparable(fedpa), path.name


def test_ablation_configs_are_the_rows_of_table_5():
    import yaml

    root = Path(__file__).resolve().parents[2] / "yaml_configs" / "ablation"

    def flat(node, prefix=""):
        if isinstance(node, dict):
            return {k: v for key, sub in node.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
        return {prefix[:-1]: node}

    def diff(name):
        cfg, full = (flat(yaml.safe_load((root / f"{n}_mnli.yaml").read_text())) for n in (name, "fedpa_full"))
        ignored = ("expname", "federate.save_to")
        return {k: cfg.get(k) for k in cfg.keys() | full.keys() if cfg.get(k) != full.get(k) and k not in ignored}

    head = {"personalization.local_param": []}
    fedit = {"federate.method": "fedit", "train.optimizer.lr": 0.01}
    flex = {"federate.method": "flexlora", "train.optimizer.lr": 0.005}
    nopres = {"federate.method": "fedpa_no_preservation"}
    expected = {
        "fedit_nohead": {**fedit, **head},
        "fedit_head": fedit,
        "flexlora_nohead": {**flex, **head},
        "flexlora_head": flex,
        "fedpa_nopres_nohead": {**nopres, **head},
        "fedpa_nopres_head": nopres,
        "fedpa_nohead": head,
        "fedpa_reg_b": {"fedpa.reg": "b"},
        "fedpa_reg_a": {"fedpa.reg": "a"},
        "fedpa_reg_both": {"fedpa.reg": "both"},
        "fedpa_noreg": {"fedpa.reg": "none"},
    }
    assert sorted(p.name for p in root.glob("*.yaml")) == sorted(f"{n}_mnli.yaml" for n in [*expected, "fedpa_full"])
    for name, changes in expected.items():
        assert diff(name) == changes, name
    full = yaml.safe_load((root / "fedpa_full_mnli.yaml").read_text())
    assert (full["data"]["type"], full["federate"]["client_num"], full["data"]["splitter_args"]) == (
        "mnli@glue",
        3,
        [{"alpha": 0.5}],
    )


def test_paper_configs_are_what_the_generator_writes():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "research/scripts/make_paper_configs.py", "--check"], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize(
    "rule,low,high",
    [("loss", 0.0, 2.0), ("grad", 0.0, 10.0), ("direction", 0.0, 4.0)],
)
def test_adaptive_lambda_rules_set_a_per_client_lambda_in_range(tiny_llm, tmp_path, rule, low, high):
    # Prepare: lam_0 = 2; ranges of Appendix F: (0, lam_0], [lam_min, lam_max], [0, 2 lam_0]
    cfg = fedpa_cfg(
        tiny_llm, tmp_path, **{"fedpa.adaptive_lam": rule, "fedpa.lam": 2.0, "federate.total_round_num": 2}
    )
    # Execute
    proc = run_fs(cfg, tmp_path)
    # Assert
    assert proc.returncode == 0, proc.stderr[-4000:]
    lams = [lam for record in _diagnostics(outdir_of(cfg)) for lam in record["lam"].values()]
    assert len(lams) == 6 and all(low <= lam <= high for lam in lams)
    assert any(lam != 2.0 for lam in lams)  # the rule, not the fixed lambda, set them


def test_mechanism_diagnostics_match_dense_products_of_what_was_sent_and_received(tiny_llm, tmp_path):
    # Prepare: references of rank R_i = 2, 3, 4 below the clients' rank 4, so the drift compares two ranks
    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"fedpa.reference_ranks": [2, 3, 4]})
    # Execute
    run = probe(cfg, tmp_path)
    records = {r["round"]: r for r in _diagnostics(run["final"]["outdir"])}
    # Assert: an independent dense computation from the uploads and the global factors the server sent
    previous = None
    for agg in run["aggregate"]:
        record = records[agg["round"]]
        total = sum(record["weights"])
        update_sq = 0.0
        for name in agg["uploads"][0]:
            X = sum(
                w / total * (u[name][0].double() @ u[name][1].double())
                for w, u in zip(record["weights"], agg["uploads"])
            )
            update_sq += float(X.pow(2).sum())
        assert record["global_update_norm"] == pytest.approx(update_sq**0.5, rel=1e-4)
        for client, upload in zip(agg["clients"], agg["uploads"]):
            R_i = [2, 3, 4][client - 1]
            delta_sq = drift_sq = ref_sq = 0.0
            for name, (B, A) in upload.items():
                dW = B.double() @ A.double()
                ref = 0 if previous is None else previous[name][0][:, :R_i].double() @ previous[name][1][:R_i].double()
                delta_sq += float(dW.pow(2).sum())
                drift_sq += float((dW - ref).pow(2).sum())
                ref_sq += float(torch.as_tensor(ref).pow(2).sum())
            c = str(client)
            assert record["delta_norm"][c] == pytest.approx(delta_sq**0.5, rel=1e-4)
            assert record["drift"][c] == pytest.approx(drift_sq**0.5, rel=1e-4)
            if ref_sq > 0:
                assert record["drift_rel"][c] == pytest.approx((drift_sq / ref_sq) ** 0.5, rel=1e-4)
            else:
                assert c not in record["drift_rel"]  # the first reference is 0
            assert record["grad_ratio_first"][c] >= 0 and record["grad_ratio_last"][c] > 0  # B = 0 at round 0 start
        assert record["spread"]["drift"][0] == pytest.approx(
            sum(record["drift"].values()) / len(record["drift"]), rel=1e-12
        )
        previous = agg["global"]
