"""The run file's ``noise_signal``: each DP-SGD client's per-round noise/signal read back from its own accounting
file (a JSON line a round, written by the sample-level client policy), never from a log line, and the report's per-client median over
the last quarter of the rounds."""

from __future__ import annotations

import json
from types import SimpleNamespace

from fs_fedpa.privacy.sample_level import SampleLevelClient, SamplePlan
from fs_fedpa.record import CLIENT_PRIVACY_FILE
from research.harness.fs_results import read_noise_signal
from research.study.report_dp_regime import noise_shares


def _client(tmp_path, client: int, norms, empty: int = 0) -> SampleLevelClient:
    """A client policy whose DP-SGD left ``norms`` (clipped sum, noise) for the round: its ``log_round`` writes."""
    privacy = SampleLevelClient.__new__(SampleLevelClient)
    privacy.fedpa = SimpleNamespace(dp=SimpleNamespace(clip=0.1, min_records=0))
    privacy.client, privacy.rnd = client, 3
    privacy.path = str(tmp_path / CLIENT_PRIVACY_FILE)
    privacy.trainer = SimpleNamespace(ctx={"num_train_data": 8214})
    plan = SamplePlan(8214, 256, 1, 0.6156, 1e-5, "poisson", "rdp")
    privacy.dp_sgd = SimpleNamespace(plan_in_use=plan, round_nonfinite=0, round_empty=empty,
                                     signal_noise=lambda: norms)  # fmt: skip
    return privacy


def test_each_clients_noise_over_signal_is_read_in_round_order(tmp_path, caplog):
    for client, norms, empty in ((10, (3.219, 6.831), 0), (2, (7.56, 6.148), 2), (10, (4.0, 2.0), 0),
                                 (2, (0.0, 6.0), 0)):  # fmt: skip  # the last: an empty round, no signal
        _client(tmp_path, client, norms, empty).log_round(4)
    found = read_noise_signal(tmp_path)
    assert found == {"10": [2.12, 0.5], "2": [0.813, None]}  # 6.831 / 3.219 = 2.122..., 6.148 / 7.56 = 0.8132...
    rows = [json.loads(line) for line in (tmp_path / CLIENT_PRIVACY_FILE).read_text().splitlines()]
    assert rows[1]["empty"] == 2 and rows[0]["steps"] == 4 and rows[0]["n"] == 8214 and rows[0]["clip"] == 0.1
    assert rows[0]["epsilon"] == SamplePlan(8214, 256, 1, 0.6156, 1e-5, "poisson", "rdp").epsilon(4)
    assert read_noise_signal(tmp_path / "missing") == {}
    # the numbers come from the file alone: rewording or dropping the log line changes nothing
    (tmp_path / "exp_print.log").write_text("client #10: DP-SGD clipped sum 1 against noise 100 \n")
    assert read_noise_signal(tmp_path) == found


def test_the_report_takes_each_clients_median_over_its_last_quarter():
    run = {"noise_signal": {"1": [9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 1.0, 3.0], "2": [5.0, 5.0, 5.0, 5.0, None, None, None,
                                                                                   None]}}  # fmt: skip
    # client 1: median of its last 2 rounds (1, 3) = 2; client 2: its last 2 have no signal, so it is left out
    assert noise_shares(run) == [2.0]
    assert noise_shares({}) == []
