"""Each client's own evaluation at its last round, read from FS's ``eval_results.log`` into the run file, and the
report's per-client table of the dpregime finals (medians over seeds, noise/signal over the last quarter)."""

from __future__ import annotations

from research.harness.fs_results import clients_last_round
from research.study import report_dp_regime as rr


def _row(role: str, rnd: int, raw: str) -> str:
    return "{'Role': '%s', 'Round': %d, 'Results_raw': {%s}}\n" % (role, rnd, raw)


def test_each_clients_last_round_is_read_with_numpy_scalars_and_nan(tmp_path):
    log = tmp_path / "eval_results.log"
    log.write_text("".join([
        _row("Client #2", 30, "'val_acc': 0.5, 'val_total': 10"),
        _row("Client #10", 30, "'val_acc': np.float64(0.123456), 'val_total': 7, 'local.val_acc': nan"),
        "{'Role': 'Server #', 'Round': 30, 'Results_weighted_avg': {'val_acc': 0.4}}\n",
        "not a dict\n",
        _row("Client #2", 60, "'val_acc': np.float64(0.87654321), 'val_f1': 0.4, 'val_total': 10, 'val_loss': 3.0"),
    ]))  # fmt: skip
    found = clients_last_round(log)
    assert list(found) == ["2", "10"]  # in client order, not text order
    assert found["2"] == {"val_acc": 0.8765, "val_f1": 0.4, "val_total": 10}  # round 60's, the loss left out
    assert found["10"] == {"val_acc": 0.1235, "val_total": 7, "local.val_acc": None}


def _run(acc: dict[str, float], f1: float, shares: dict[str, list] | None = None) -> dict:
    run = {"clients": {c: {"val_total": 50, "local.val_acc": a, "local.val_f1": f1} for c, a in acc.items()}}
    return {**run, "noise_signal": shares} if shares is not None else run


def test_the_per_client_table_takes_medians_over_seeds_and_each_clients_last_quarter():
    share = [9.0] * 6 + [1.0, 3.0]  # last quarter: the last 2 of 8 rounds, median 2
    results = {
        "dpregime/fedpa_dp_s0": _run({"1": 0.6, "3": 0.9}, 0.40, {"1": share}),
        "dpregime/fedpa_dp_s1": _run({"1": 0.7, "3": 0.8}, 0.30, {"1": [4.0] * 8}),
        "dpregime/fedpa_dp_s2": _run({"1": 0.9, "3": 0.7}, 0.35, {"1": [None] * 8}),  # no signal: left out
        "dpregime/fedit_s0": _run({"1": 0.85}, 0.8),
        "final/fedpa_dp_s0": _run({"1": 0.1}, 0.1),  # another stage
    }
    lines = rr.client_lines(results)
    one = next(line for line in lines if line.startswith("| 1 |"))
    three = next(line for line in lines if line.startswith("| 3 |"))
    # fedpa_dp, client 1: accuracy median(0.6, 0.7, 0.9) = 0.7, F1 median 0.35, noise/signal median(2, 4) = 3
    assert one.split(" | ")[2] == "3; 0.700 / 0.35 (3)"
    assert one.split(" | ")[3:5] == ["–", "–"]  # fedit_dp, ffa_lora_dp: no run
    assert one.rstrip(" |").endswith("0.850 / 0.80 (1)")  # fedit without DP: no noise column
    assert three.split(" | ")[2] == "–; 0.800 / 0.35 (3)"  # takes no DP step
    assert rr.client_lines({"dpregime/fedpa_dp_s0": {"rounds": {}}}) == []
