"""FedPA in FS's distributed (gRPC) mode: a server and three clients, each its own process on 127.0.0.1."""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.integration.conftest import fedpa_cfg, probe
from tests.integration.tiny_assets import dump_yaml, fs_env, outdir_of, read_eval_results

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("distributed")]  # one worker: 4 processes each


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def distributed_cfgs(base: dict, save_dir: Path) -> list[dict]:
    """Server and client yamls for ``base`` (client i owns data shard i, as in standalone)."""
    ports = _free_ports(1 + base["federate"]["client_num"])
    cfgs = []
    for role_idx, port in enumerate(ports):
        cfg = copy.deepcopy(base)
        cfg["federate"]["mode"] = "distributed"
        cfg["federate"]["share_local_model"] = False  # one client per process: nothing to share
        cfg["federate"]["save_to"] = str(save_dir / "ckpt.pt")
        cfg["distribute"] = {
            "use": True,
            "server_host": "127.0.0.1",
            "server_port": ports[0],
            "client_host": "127.0.0.1",
            "client_port": port,
            "role": "server" if role_idx == 0 else "client",
            "data_idx": role_idx,
        }
        cfg["expname"] = f"{base['expname']}_{'server' if role_idx == 0 else f'client{role_idx}'}"
        cfgs.append(cfg)
    return cfgs


def run_distributed(cfgs: list[dict], tmp_path: Path, timeout: float = 240) -> int:
    """``scripts/run_distributed.sh`` on the dumped yamls (server first), with a bounded wait and cleanup."""
    paths = [dump_yaml(cfg, tmp_path / f"party{i}.yaml") for i, cfg in enumerate(cfgs)]
    env = fs_env({"LOGDIR": str(tmp_path), "JOIN_WAIT": "5", "PYTHON": sys.executable})
    proc = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "run_distributed.sh"), *paths], cwd=tmp_path, env=env, start_new_session=True
    )
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and every party
        proc.wait(timeout=30)
        raise
    finally:
        try:  # no party outlives its test (the next test finds the server by its command line)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_distributed_fedpa_matches_standalone(tiny_llm, tmp_path):
    # Prepare: a rank-R_i reference per client (each downlink differs); no shuffling and no dropout, so both
    # modes see the same batches in the same order
    changes = {"dataloader.shuffle": False, "fedpa.reference_ranks": [2, 3, 4], "federate.save_to": ""}
    base = fedpa_cfg(tiny_llm, tmp_path, **changes)
    standalone = probe(base, tmp_path)
    cfgs = distributed_cfgs(base, tmp_path / "dist")
    # Execute
    status = run_distributed(cfgs, tmp_path)
    logs = [(tmp_path / f"party{i}.log").read_text() for i in range(len(cfgs))]
    # Assert: every party finished; global adapter, each client's own factors and the metrics match
    assert status == 0, "\n\n".join(log[-3000:] for log in logs)
    for i in (1, 2, 3):
        assert f"is assigned with #{i}" in logs[i]
    final = torch.load(tmp_path / "dist" / "final_ckpt.pt", weights_only=False)["fedpa"]["global"]
    for name, (B, A) in standalone["final"]["global"].items():
        torch.testing.assert_close(final[name][0] @ final[name][1], B @ A, atol=1e-5, rtol=0)
    for cid, factors in standalone["final"]["clients"].items():  # the files' applied, the probe's raw (B / s_i)
        own = torch.load(tmp_path / "dist" / f"fedpa_client_{cid}_ckpt.pt", weights_only=False)["factors"]
        for name, (B, A) in factors.items():
            torch.testing.assert_close(own[name][0], 8 / B.shape[1] * B, atol=1e-5, rtol=0)
            torch.testing.assert_close(own[name][1], A, atol=1e-5, rtol=0)
    received = [r for r in standalone["enter"] if r["round"] == 1]
    assert sorted(r["received_ranks"][0] for r in received) == [2, 3, 4]
    server = read_eval_results(outdir_of(cfgs[0]))
    local = [r["Results_weighted_avg"] for r in read_eval_results(outdir_of(base)) if "Results_weighted_avg" in r]
    remote = [r["Results_weighted_avg"] for r in server if "Results_weighted_avg" in r]
    assert len(local) == len(remote) == 3
    for a, b in zip(local, remote):
        assert a.keys() == b.keys()
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), key


@pytest.mark.parametrize("min_received", [1, 3])
def test_a_killed_client_neither_hangs_the_server_nor_the_others(tiny_llm, tmp_path, min_received):
    """1 + 3 parties on loopback; client 3 is killed as soon as training starts, so its updates stop coming.
    With fedpa.net.round_timeout_s 8, the server aggregates the two updates that do arrive (min_received 1), merges the
    evaluations it gets and finishes; or, when that is fewer than fedpa.net.min_received (3), it stops with the reason.
    Either way the live clients exit with it: nothing waits forever."""
    import time

    changes = {"federate.save_to": "", "fedpa.net.round_timeout_s": 8.0, "fedpa.net.min_received": min_received}
    changes["federate.total_round_num"] = 2  # a round after the one that timed out: the timeout holds again
    base = fedpa_cfg(tiny_llm, tmp_path, **changes)
    cfgs = distributed_cfgs(base, tmp_path / "dist")
    env = fs_env({"PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"})  # the log shows when training starts
    parties, logs = [], [tmp_path / f"party{i}.log" for i in range(4)]
    try:
        for i, cfg in enumerate(cfgs):
            path = dump_yaml(cfg, tmp_path / f"party{i}.yaml")
            with open(logs[i], "w") as log:
                cmd = [sys.executable, "-m", "federatedscope.main", "--cfg", path]
                parties.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
            time.sleep(5)  # FS numbers clients in the order they join
        deadline = time.time() + 120
        while "Starting training (Round #0)" not in logs[0].read_text():
            assert time.time() < deadline and parties[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.05)
        parties[3].kill()
        codes = [p.wait(timeout=180) for p in parties[:3]]
    finally:
        for p in parties:
            if p.poll() is None:
                p.kill()
    server = logs[0].read_text()
    if min_received == 3:
        assert codes[0] != 0 and codes[1:] == [0, 0], server[-3000:]
        assert "2 of 3 updates within fedpa.net.round_timeout_s=8 s, fewer than fedpa.net.min_received=3" in server
        return
    assert codes == [0, 0, 0], server[-3000:]
    assert "no update from clients [3] within fedpa.net.round_timeout_s=8 s; aggregating the 2 that arrived" in server
    rounds = [line for line in server.splitlines() if "[fedpa] round" in line and "E_agg" in line]
    assert len(rounds) == 2  # every round aggregated


def test_a_client_puts_what_it_receives_on_its_trainers_device_not_where_fs_parked_the_model():
    """With ``share_local_model False`` FS parks the model on the host between routines (``discharge_model``) and
    moves it to the trainer's device when one starts: a reference or factors put "where the model is" at message time
    would land on the host and meet the factors on the accelerator in the penalty. Here the model is parked on the
    meta device, which no CPU run has, so the device the client picks must come from its trainer."""
    from types import SimpleNamespace

    peft = pytest.importorskip("peft")
    from fs_fedpa.plugin.client_model import ClientModel

    base = torch.nn.Sequential(torch.nn.Linear(6, 5))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"])).to("meta")
    client = SimpleNamespace(model=model, trainer=SimpleNamespace(ctx=SimpleNamespace(device="cpu")))
    assert ClientModel.device.fget(client) == torch.device("cpu")
    client.trainer.ctx.device = "cuda:1"
    assert ClientModel.device.fget(client) == torch.device("cuda:1")
    del client.trainer.ctx.device  # no trainer device (a test double): where the factors are
    assert ClientModel.device.fget(client) == torch.device("meta")
