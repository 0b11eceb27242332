"""Reliability in real FS runs: faulty uploads dropped with a reason, determinism per seed, kill and resume."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fs_fedpa.methods import names
from fs_fedpa.record import without_timings
from fs_fedpa.run_summary import TIMING_KEYS
from tests.conftest import ROOT
from tests.integration.conftest import fedpa_cfg, probe
from tests.integration.tiny_assets import dump_yaml, fs_env, run_fs, run_module

pytestmark = pytest.mark.integration


def _diagnostics(run) -> list[dict]:
    """The run's round records without the fields that measure time or memory."""
    path = Path(run["final"]["outdir"]) / "fedpa_diagnostics.jsonl"
    return [without_timings(json.loads(line)) for line in path.open()]


SUMMARY_KEYS = {"format", "method", "rank_plan", "metric", "rounds", "final", "best", "bytes", "wall_minutes",
                "peak_memory", "privacy", "export", "commit", "tracker", "curve"}  # fmt: skip


def _summary(run) -> dict:
    """The run's summary.json, every key of docs/observability.md there, without its times and memory."""
    summary = json.loads((Path(run["final"]["outdir"]) / "summary.json").read_text())
    assert set(summary) == SUMMARY_KEYS
    assert summary["wall_minutes"] > 0 and summary["peak_memory"]["bytes"] > 0
    assert summary["final"]["global"] and summary["bytes"]["total"] > 0
    for entry in summary["curve"]:
        assert entry.pop("minutes") > 0 and entry.pop("eval_seconds")
    return {k: v for k, v in summary.items() if k not in TIMING_KEYS}


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


def test_a_pickled_upload_is_dropped_unread_and_training_goes_on(tiny_llm, tmp_path):
    # Execute: in round 1, client 2 sends as its B a base64 pickle that would create a file when unpickled (FS's
    # own param2tensor unpickles any string it is given)
    planted = tmp_path / "pwned"
    env = {"FS_PROBE_CORRUPT": "2:1:pickle", "FS_PROBE_CANARY": str(planted)}
    run = probe(fedpa_cfg(tiny_llm, tmp_path), tmp_path, env=env)
    # Assert: refused with its reason, never unpickled, and the federation went on without it
    log = (tmp_path / "probe.log").read_text()
    assert "dropped the upload of client #2" in log and "safetensors header" in log
    assert not planted.exists()
    agg = {a["round"]: a for a in run["aggregate"]}
    assert sorted(agg[1]["clients"]) == [1, 2, 3] and agg[1]["uploads"][agg[1]["clients"].index(2)] is None
    assert sorted(_diagnostics(run)[1]["clients"]) == [1, 3] and sorted(_diagnostics(run)[2]["clients"]) == [1, 2, 3]


def test_a_client_whose_own_factors_turn_nan_restarts_from_the_reference(tiny_llm, tmp_path):
    run = probe(fedpa_cfg(tiny_llm, tmp_path), tmp_path, env={"FS_PROBE_NAN_LOCAL": "2:1"})
    log = (tmp_path / "probe.log").read_text()
    assert "client #2, round 1: its own factors or local tensors became non-finite" in log
    diag = {d["round"]: d for d in _diagnostics(run)}
    assert diag[1]["restarted"] == [2] and diag[1]["dropped"] == {} and diag[2]["restarted"] == []
    # what it sent and keeps in round 1 is the reference it received: same product, finite, at its rank
    received = next(e for e in run["enter"] if e["client"] == 2 and e["round"] == 1)
    sent = next(s for s in run["sent"] if s["client"] == 2 and s["round"] == 1)["parts"]
    reference = {a["round"]: a for a in run["aggregate"]}[0]["global"]  # the global it received in round 1
    for name, parts in sent.items():
        B, A = parts["B"].double(), parts["A"].double()
        assert torch.isfinite(B).all() and torch.isfinite(A).all() and B.shape == received["start"][name][0].shape
        torch.testing.assert_close(B @ A, reference[name][0].double() @ reference[name][1].double(), atol=1e-6, rtol=0)
    # and it trains on: round 2 starts from finite factors and every client is aggregated again
    start = next(e for e in run["enter"] if e["client"] == 2 and e["round"] == 2)["start"]
    assert all(torch.isfinite(B).all() and torch.isfinite(A).all() for B, A in start.values())
    assert sorted(diag[2]["clients"]) == [1, 2, 3]


def test_a_second_update_or_an_unknown_sender_is_ignored_and_the_round_goes_on(tiny_llm, tmp_path):
    faults = "1:1:duplicate,2:2:extra sender 99"
    run = probe(
        fedpa_cfg(tiny_llm, tmp_path, **{"federate.total_round_num": 4}), tmp_path, env={"FS_PROBE_CORRUPT": faults}
    )
    log = (tmp_path / "probe.log").read_text()
    assert "round 1: ignored a message: client #1 already sent its update of round 1" in log
    assert "ignored a message: sender id '99' is not a client of this run (1..3)" in log
    diag = _diagnostics(run)
    assert [sorted(d["clients"]) for d in diag] == [[1, 2, 3]] * 4 and all(d["dropped"] == {} for d in diag)
    outdir = Path(run["final"]["outdir"])
    assert "'Round': 4" in (outdir / "eval_results.log").read_text()  # the run reached its final evaluation


def test_a_round_with_every_upload_dropped_keeps_the_global_adapter(tiny_llm, tmp_path):
    run = probe(fedpa_cfg(tiny_llm, tmp_path), tmp_path, env={"FS_PROBE_CORRUPT": "1:1:nan,2:1:nan,3:1:shape"})
    log = (tmp_path / "probe.log").read_text()
    assert "every upload was dropped; the global adapter stays as it was" in log
    agg = {a["round"]: a for a in run["aggregate"]}
    for name, (B, A) in agg[1]["global"].items():  # bit for bit the round-0 global
        assert torch.equal(B, agg[0]["global"][name][0]) and torch.equal(A, agg[0]["global"][name][1])
    assert not any(torch.equal(B, agg[1]["global"][n][0]) for n, (B, _) in agg[2]["global"].items())
    assert len(_diagnostics(run)) == 3 and _diagnostics(run)[1]["clients"] == []


def test_rounds_in_a_row_with_every_upload_dropped_stop_the_run_with_the_reason(tiny_llm, tmp_path):
    cfg = dump_yaml(fedpa_cfg(tiny_llm, tmp_path, **{"federate.total_round_num": 6}), tmp_path / "probe.yaml")
    faults = ",".join(f"{c}:{r}:nan" for c in (1, 2, 3) for r in (1, 2, 3))
    proc = run_module("tests.integration.fs_probe", [cfg, tmp_path / "probe.pt"], ROOT,
                      fs_env({"FS_PROBE_CORRUPT": faults}), 300)  # fmt: skip
    assert proc.returncode != 0
    assert "3 rounds in a row had every upload dropped (fedpa.max_failed_rounds=3)" in proc.stderr
    assert "Starting a new training round (Round #4)" not in proc.stdout + proc.stderr


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


def _kill_after_resume_point(cfg: dict, tmp_path: Path, rnd: int) -> Path:
    """Run FS until the resume point of round ``rnd`` is written, then kill it (as a crash would)."""
    cfg_file = dump_yaml(cfg, tmp_path / "killed.yaml")
    proc = subprocess.Popen(
        [sys.executable, "-m", "federatedscope.main", "--cfg", cfg_file],
        cwd=tmp_path,
        env=fs_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if f"resume point for round {rnd} written to" in line:
                proc.kill()
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert any(f"resume point for round {rnd}" in line for line in seen), "".join(seen[-30:])
    return Path(cfg["federate"]["save_to"]).parent / f"fedpa_resume_{Path(cfg['federate']['save_to']).name}"


# Every registered method (issue 74). Among them: FLoRA merges into the base weights and draws a fresh A per round;
# FedDPA-T keeps a personal adapter; Fed-PLoRA draws its clients' modules per round (ranks 1, 2, 4) and folds the
# others into the base weights; Ravan keeps cores and scales instead of factors and draws its clients' heads per
# round; HetLoRA's server keeps each client's pruned rank, which sizes its downlink (the recorded bytes)
def _crash_after_resume_point(cfg: dict, tmp_path: Path, rnd: int) -> Path:
    """Run FS (forked from the tests' zygote) until the resume point of round ``rnd`` is written, then end the process
    there without clean-up, as a kill would (``FS_PROBE_CRASH_AFTER_RESUME``)."""
    cfg_file = dump_yaml(cfg, tmp_path / "killed.yaml")
    proc = run_module("tests.integration.fs_probe", [cfg_file, tmp_path / "unused.pt"], ROOT,
                      fs_env({"FS_PROBE_CRASH_AFTER_RESUME": str(rnd)}), 300)  # fmt: skip
    assert proc.returncode == 137, proc.stdout[-2000:] + proc.stderr[-3000:]
    point = Path(cfg["federate"]["save_to"]).parent / f"fedpa_resume_{Path(cfg['federate']['save_to']).name}"
    assert torch.load(point, weights_only=True)["fedpa_resume"]["round"] == rnd
    return point


def _takes_mixed_ranks(method: str) -> bool:
    """Whether ``method`` accepts clients of ranks 1, 2 and 4 (its own check, not a list of names)."""
    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.core.ranks import RankPlan
    from fs_fedpa.methods import get_method

    try:
        get_method(method)(FedPAConfig(client_ranks=[1, 2, 4]), RankPlan.build(3, 4, client_ranks=[1, 2, 4]))
    except ValueError:
        return False
    return True


def _resume_cases():
    """Every method under heterogeneous ranks wherever it accepts them, and under the adapter's own rank for every
    client (FS's plain LoRA config): a global whose rank is not the adapter's (Ravan's H r_h, FedPA's R_g) is then
    loaded into the model the clients share (issue 88: Ravan could not resume so)."""
    for method in names():
        if mixed := _takes_mixed_ranks(method):
            yield pytest.param(method, True, {}, id=method)
        yield pytest.param(method, False, {}, id=f"{method}-equal_ranks" if mixed else method)
    # the clients' AdamW moments, kept across rounds, go through the state store and the resume files
    yield pytest.param("fedpa", True, {"fedpa.keep_moments": True}, id="fedpa-keep_moments")


@pytest.mark.parametrize(("method", "mixed_ranks", "options"), _resume_cases())
def test_a_run_killed_after_round_k_resumes_to_the_same_result(tiny_llm, tmp_path, method, mixed_ranks, options):
    # Prepare: 4 rounds, 2 of 3 clients sampled per round (the sampler's state matters), one model shared by the
    # clients (FS's default for LLMs), resume points on
    def cfg(name, **more):
        (tmp_path / name).mkdir()
        changes = {"federate.total_round_num": 4, "federate.sample_client_num": 2, "expname": name,
                   "federate.share_local_model": True}  # fmt: skip
        changes["federate.method"] = method
        if mixed_ranks:
            changes["fedpa.client_ranks"] = "[1, 2, 4]"
        if method.startswith("hetlora"):  # a strong tail penalty prunes all of client 3's modules in round 2
            changes["fedpa.hetlora.lam"] = 50.0
        changes["federate.save_to"] = str(tmp_path / name / "ckpt" / "run.pt")
        return fedpa_cfg(tiny_llm, tmp_path / name, **changes, **options, **more)

    full = probe(cfg("full"), tmp_path / "full")
    # Execute: the same run ended without clean-up once round 2's resume point is written (as a kill would; the tests
    # below kill a live process), then resumed from it; both with a state budget of about one client, so the
    # clients' states are spilled to disk and read back between their rounds
    tight = {"fedpa.store.state_budget_mb": 0.001}
    # HetLoRA: killed once round 3 has started, so that round 2's pruning must survive the resume (it sizes client
    # 3's round-3 downlink)
    kill = 3 if method.startswith("hetlora") else 2
    point = _crash_after_resume_point(cfg("killed", **tight), tmp_path / "killed", rnd=kill)
    resumed = probe(cfg("resumed", **{"federate.restore_from": str(point)}, **tight), tmp_path / "resumed")
    # Assert: the same global adapter, client factors and metrics, bit for bit
    assert [a["round"] for a in resumed["aggregate"]] == list(range(kill, 4))
    for name, (B, A) in full["final"]["global"].items():
        assert torch.equal(B, resumed["final"]["global"][name][0]) and torch.equal(
            A, resumed["final"]["global"][name][1]
        )
    assert full["final"]["clients"].keys() == resumed["final"]["clients"].keys()
    parts = [(full["final"]["merged"], resumed["final"]["merged"])]  # merges into the base weights (FLoRA)
    parts += [(full["final"]["offsets"][c], resumed["final"]["offsets"][c]) for c in (1, 2, 3)]
    for full_part, resumed_part in parts:
        assert full_part.keys() == resumed_part.keys()  # merges: FLoRA's, FedEx-LoRA's residual
        assert all(torch.equal(t, resumed_part[n]) for n, t in full_part.items())
    personal = full["final"]["personal"]
    assert personal.keys() == resumed["final"]["personal"].keys()  # FedDPA's personal adapters
    for cid, factors in personal.items():
        for name, (B, A) in factors.items():
            assert torch.equal(B, resumed["final"]["personal"][cid][name][0]), (cid, name)
            assert torch.equal(A, resumed["final"]["personal"][cid][name][1]), (cid, name)
    for cid, factors in full["final"]["clients"].items():
        for name, (B, A) in factors.items():
            assert torch.equal(B, resumed["final"]["clients"][cid][name][0]), (cid, name)
            assert torch.equal(A, resumed["final"]["clients"][cid][name][1]), (cid, name)

    def later_rounds(run):
        lines = (Path(run["final"]["outdir"]) / "eval_results.log").read_text().splitlines()
        return [line for line in lines if re.search(rf"'Round': [{kill}-3],", line)]

    assert later_rounds(full) and later_rounds(full) == later_rounds(resumed)
    # the diagnostics history continues: the rounds before the kill carried over, the rest recomputed identically
    # (the bytes each client received and sent among them)
    assert [d["round"] for d in _diagnostics(resumed)] == [0, 1, 2, 3]
    assert _diagnostics(resumed) == _diagnostics(full)
    # the summary (issue 90): every key, and the same as the uninterrupted run's but for times and memory (the
    # evaluation that closed the round before the kill, whose results the resume point could not hold, asked again)
    for record in map(json.loads, (Path(full["final"]["outdir"]) / "fedpa_diagnostics.jsonl").open()):
        assert record["aggregate_seconds"] > 0 and record["server_peak_memory"] > 0 and record["memory_kind"] == "rss"
        clients = {str(c) for c in record["clients"]}  # each aggregated client measured its training
        assert set(record["train_seconds"]) == set(record["train_batches"]) == clients
        assert all(record["train_batches"][c] > 0 and record["examples_per_s"][c] > 0 for c in clients)
    assert [e["round"] for e in _summary(full)["curve"]] == [0, 1, 2, 3]
    assert _summary(resumed) == _summary(full)


def test_restore_from_a_file_that_is_not_a_resume_point_is_refused(tiny_llm, tmp_path):
    torch.save({"cur_round": 1, "model": {}}, tmp_path / "plain.pt")
    for path, message in (
        (tmp_path / "plain.pt", "is not a FedPA resume point"),
        (tmp_path / "no.pt", "no such file"),
    ):
        proc = run_fs(fedpa_cfg(tiny_llm, tmp_path), tmp_path, extra_opts=["federate.restore_from", str(path)])
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_resume_refuses_what_would_lose_or_change_the_run(tiny_llm, tmp_path):
    """One resume point (round 2 of 4), then each way of resuming that must be refused before training, with the
    reason: nothing left to train, a result-changing key changed, client files missing, a truncated or planted
    server file (which must run nothing)."""
    from tests.integration.fault_cases import Canary

    (tmp_path / "killed").mkdir()
    base = {"federate.total_round_num": 4, "expname": "killed"}
    base["federate.save_to"] = str(tmp_path / "killed" / "ckpt" / "run.pt")
    point = _kill_after_resume_point(fedpa_cfg(tiny_llm, tmp_path / "killed", **base), tmp_path / "killed", rnd=2)

    def refused(name: str, path: Path, **changes) -> str:
        (tmp_path / name).mkdir()
        cfg = fedpa_cfg(tiny_llm, tmp_path / name, **{**base, "expname": name, "federate.restore_from": str(path)})
        opts = [x for k, v in changes.items() for x in (k, str(v))]
        proc = run_fs(cfg, tmp_path / name, extra_opts=opts, timeout=120)
        assert proc.returncode != 0, name
        assert "Starting training" not in proc.stdout + proc.stderr, name
        return proc.stderr

    assert "nothing is left to train" in refused("done", point, **{"federate.total_round_num": 2})
    assert "saved with other settings (fedpa.lam: saved 1.0, now 0.5)" in refused("lam", point, **{"fedpa.lam": 0.5})
    copy = tmp_path / "copy" / point.name
    copy.parent.mkdir()
    copy.write_bytes(point.read_bytes())  # the server file without the clients' files beside it
    assert "are missing" in refused("no_clients", copy)
    truncated = tmp_path / "trunc_file" / point.name
    truncated.parent.mkdir()
    truncated.write_bytes(point.read_bytes()[:200])
    assert "cannot be read as a resume file" in refused("truncated", truncated)
    planted, bomb = tmp_path / "pwned", tmp_path / "bomb" / "fedpa_resume_run.pt"
    bomb.parent.mkdir()
    torch.save({"cur_round": 2, "fedpa_resume": Canary(str(planted))}, bomb)
    assert "cannot be read as a resume file" in refused("planted", bomb)
    assert not planted.exists()


def test_resume_refuses_a_file_of_another_owner_or_with_a_malformed_field(tiny_llm, tmp_path):
    """Each client file records whose it is (client id, r_i and R_i, the run); the restore checks that and every
    field of the client files and of the server file. One resume point (round 2 of 4, r = 4), then each bad variant
    of it, refused before training with a message naming the file and the field."""
    (tmp_path / "killed").mkdir()
    base = {"federate.total_round_num": 4, "expname": "killed"}
    base["federate.save_to"] = str(tmp_path / "killed" / "ckpt" / "run.pt")
    point = _kill_after_resume_point(fedpa_cfg(tiny_llm, tmp_path / "killed", **base), tmp_path / "killed", rnd=2)
    c1, c2 = f"{point.name}.client1.r1", f"{point.name}.client2.r1"  # what clients 1 and 2 restore at round 2

    def refused(name: str, edit) -> tuple[str, Path]:
        """Copy the resume point and its clients' files, ``edit`` them (file name -> content), resume from them."""
        folder = tmp_path / name / "ckpt"
        folder.mkdir(parents=True)
        files = {p.name: torch.load(p, weights_only=True) for p in point.parent.glob(f"{point.name}*")}
        edit(files)
        for file, content in files.items():
            torch.save(content, folder / file)
        changes = {**base, "expname": name, "federate.restore_from": str(folder / point.name)}
        changes["federate.save_to"] = str(tmp_path / name / "out" / "run.pt")
        proc = run_fs(fedpa_cfg(tiny_llm, tmp_path / name, **changes), tmp_path / name, timeout=120)
        assert proc.returncode != 0, name
        assert "Starting training" not in proc.stdout + proc.stderr, name
        return proc.stderr, folder

    def swap(files):
        files[c1], files[c2] = files[c2], files[c1]

    def rank_2(files, field=2):  # client 1's factors (and its rank field) as a rank-2 run would have saved them
        files[c1]["factors"] = {n: (B[:, :2].clone(), A[:2].clone()) for n, (B, A) in files[c1]["factors"].items()}
        files[c1]["rank"] = field

    def edit(file, key, value=None, delete=False):
        def apply(files):
            target = files[file]["fedpa_resume"] if file == point.name else files[file]
            if delete:
                target.pop(key, None)  # (a file that predates the field has none)
            else:
                target[key] = value

        return apply

    def nan_global(files):
        B = next(iter(files[point.name]["fedpa_resume"]["global_model"]["factors"].values()))[0]
        B[0, 0] = float("nan")

    def inf_factor(files):
        A = next(iter(files[c1]["factors"].values()))[1]
        A[0, 0] = float("inf")

    for name, change, messages, file in (
        ("swapped", swap, ["field 'client' is 2, but the file is client 1's"], c1),
        ("rank_2_run", rank_2, ["field 'rank' is 2, but this run's rank plan gives client 1 r_i=4"], c1),
        ("rank_2_factors", lambda f: rank_2(f, field=4), ["field 'factors[", ", 2), A (2, "], c1),
        ("old_file", edit(c1, "run", delete=True), ["has no field 'run': it predates the check"], c1),
        ("rounds_trained", edit(c1, "rounds_trained", delete=True), ["has no field 'rounds_trained'"], c1),
        ("client_round", edit(c1, "round", "1"), ["field 'round' is '1'; it must be an int >= 0"], c1),
        ("inf_factor", inf_factor, ["field 'factors[", "A holds a NaN or an Inf"], c1),
        ("nan_global", nan_global, ["field 'global_model.factors[", "B holds a NaN or an Inf"], point.name),
        ("round_string", edit(point.name, "round", "2"), ["field 'round' is '2'; it must be an int >= 0"], point.name),
        ("round_negative", edit(point.name, "round", -1), ["field 'round' is -1; it must be an int >= 0"], point.name),
    ):
        stderr, folder = refused(name, change)
        assert all(m in stderr for m in messages) and str(folder / file) in stderr, (name, stderr[-3000:])


FULL_DISK = """
import errno, runpy, sys
import torch

save = torch.save


def save_or_fail(obj, f, *args, **kwargs):  # the disk fills up while the resume point of round 2 is written
    if isinstance(obj, dict) and isinstance(obj.get("fedpa_resume"), dict) and obj["fedpa_resume"]["round"] == 2:
        if hasattr(f, "write"):
            f.write(b"partial")
        else:
            open(f, "wb").write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    return save(obj, f, *args, **kwargs)


torch.save = save_or_fail
sys.argv = ["federatedscope.main", "--cfg", sys.argv[1]]
runpy.run_module("federatedscope.main", run_name="__main__", alter_sys=True)
"""


def test_a_full_disk_while_writing_a_resume_point_names_the_file_and_keeps_the_earlier_one(tiny_llm, tmp_path):
    from fs_fedpa import resume

    # Prepare: 3 rounds with resume points; the disk is full (ENOSPC) when the one of round 2 is written
    save_to = tmp_path / "ckpt" / "run.pt"
    cfg_file = dump_yaml(fedpa_cfg(tiny_llm, tmp_path, **{"federate.save_to": str(save_to)}), tmp_path / "cfg.yaml")
    point = save_to.parent / f"fedpa_resume_{save_to.name}"
    # Execute
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, cfg_file],
        cwd=tmp_path,
        env=fs_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    # Assert: a message naming the file and the full disk; the resume point of round 1 and the clients' files intact
    assert proc.returncode != 0
    assert f"the disk is full: cannot write the resume file {point}" in proc.stderr, proc.stderr[-3000:]
    assert resume.load(point)["fedpa_resume"]["round"] == 1
    for client in (1, 2, 3):
        assert sorted(resume.client_files(str(point), client)) == [0, 1]
        assert resume.load(resume.client_path(str(point), client, 1))["rounds_trained"] == 2
    assert not list(save_to.parent.glob("*.tmp"))


def test_resume_refuses_hostile_files_ledgers_and_fields_naming_each(tiny_llm, tmp_path):
    """Issue 88, one seeded client-level DP run killed after round 2's resume point (and a second run of the same
    settings), then each way a resume point's files and fields were taken, refused before training with one line
    naming the file and the field. Before: a FIFO ledger hung the resume; /dev/zero or a 20 GB sparse ledger was read
    whole; ``privacy.rounds -5`` (ledger gone) restarted the count at 0; another run's ledger was continued with a
    warning (epsilon understated); malformed ``rng``, ``privacy.generator``, ``fs_results`` and a missing ``model``
    ended in bare TypeError/RuntimeError/KeyError; the other run's client files were restored."""
    import os

    from fs_fedpa import resume
    from tests.integration.test_privacy_fs import _killed_at_round_2

    point, cfg = _killed_at_round_2(tiny_llm, tmp_path, **{"fedpa.dp.seed": 11})
    ledger = Path(torch.load(point, weights_only=True)["fedpa_resume"]["privacy"]["ledger"])
    other = _kill_after_resume_point(cfg("other"), tmp_path / "other", rnd=2)  # same settings, another run

    fifo, sparse, tampered = tmp_path / "fifo.jsonl", tmp_path / "sparse.jsonl", tmp_path / "other_ledger.jsonl"
    os.mkfifo(fifo)
    with open(sparse, "wb") as f:
        f.truncate(20 * 2**30)
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    lines[0]["dp_epsilon"] /= 2  # well-formed lines, but not this run's
    tampered.write_text("".join(json.dumps(line) + "\n" for line in lines))

    def resumed_from(name: str, edit, data_type: str | None = None):
        """The resume point and its clients' files copied, ``edit``-ed (file name -> content), resumed from."""
        folder = tmp_path / name / "ckpt"
        resumed = cfg(name, **{"federate.restore_from": str(folder / point.name),
                               "federate.save_to": str(tmp_path / name / "out" / "run.pt")})  # fmt: skip
        folder.mkdir(parents=True)
        files = {p.name: torch.load(p, weights_only=True) for p in point.parent.glob(f"{point.name}*")}
        edit(files)
        for file, content in files.items():
            torch.save(content, folder / file)
        if data_type:
            resumed["data"]["type"] = data_type
        return run_fs(resumed, tmp_path / name, timeout=180), folder

    def refused(name: str, edit, data_type: str | None = None) -> tuple[str, Path]:
        proc, folder = resumed_from(name, edit, data_type)
        assert proc.returncode != 0, name
        assert "Starting training" not in proc.stdout + proc.stderr, name
        return proc.stderr, folder

    def privacy(**fields):
        return lambda files: files[point.name]["fedpa_resume"]["privacy"].update(fields)

    def head(key, value):
        return lambda files: files[point.name]["fedpa_resume"].update({key: value})

    def drop_model(files):
        del files[point.name]["model"]

    def other_clients(files):  # the other run's client files, under this point's names
        for p in other.parent.glob(f"{other.name}.client*"):
            files[p.name] = torch.load(p, weights_only=True)

    rng = resume.rng_state()
    cases = [
        ("ledger_fifo", privacy(ledger=str(fifo)), [f"the DP ledger {str(fifo)!r}", "it is a FIFO"]),
        ("ledger_dev_zero", privacy(ledger="/dev/zero"), ["the DP ledger '/dev/zero'", "it is a device"]),
        ("ledger_sparse", privacy(ledger=str(sparse)), [f"the DP ledger {str(sparse)!r}", "21474836480 bytes"]),
        ("rounds_negative", privacy(rounds=-5, ledger=str(tmp_path / "gone.jsonl")),
         ["field 'privacy.rounds' is -5; it must be an int from 0 to the point's round 2"]),
        ("other_ledger", privacy(rounds=0, ledger=str(tampered)),
         [f"the DP ledger {str(tampered)!r} of the run this resumes does not begin with the", "ledger_sha256"]),
        ("generator", privacy(generator=torch.zeros(3, dtype=torch.uint8)),
         ["field 'privacy.generator' is a torch.uint8 tensor of shape (3,)"]),
        ("rng", head("rng", {**rng, "numpy": ["MT19937", [1, 2], 0, 0, 0.0]}), ["field 'rng.numpy' is not a numpy"]),
        ("fs_results", head("fs_results", {"history_results": [1], "best_results": {}}),
         ["field 'fs_results.history_results' is a list"]),
        ("no_model", drop_model, ["field 'model' is missing"]),
        ("other_run_clients", other_clients, ["field 'file_id' is", "'s files as", "another run's file"]),
    ]  # fmt: skip
    for name, edit, messages in cases:
        stderr, folder = refused(name, edit)
        assert all(m in stderr for m in messages) and str(folder) in stderr, (name, stderr[-3000:])
        assert "Traceback" not in stderr.split("ValueError")[-1], (name, stderr[-3000:])
    # but a file of this run newer than the one the point recorded is the client's own later state (distributed: a
    # straggler of the round before the point wrote it after the point): resumed, not refused
    def recorded_earlier(files):
        head = files[point.name]["fedpa_resume"]
        head["client_files"] = {c: (r - 1, token) for c, (r, token) in head["client_files"].items()}

    proc, _ = resumed_from("straggler", recorded_earlier)
    assert proc.returncode == 0 and "resumed its state of round" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    # the clients' data changed: refused at start, naming the client's file and both sizes (before: every later
    # upload was refused, the run trained nothing and exited 0, each client's own file stating a smaller epsilon)
    lines = Path(tiny_llm["data"]).read_text().splitlines()
    bigger = tmp_path / "bigger.jsonl"
    bigger.write_text("\n".join(lines + lines[: len(lines) // 2]) + "\n")
    stderr, folder = refused("other_data", lambda files: None, data_type=f"{bigger}@llm")
    assert "field 'data.n' is" in stderr and "but the client's training set now has" in stderr, stderr[-3000:]
