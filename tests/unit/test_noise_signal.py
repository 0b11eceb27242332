"""The run file's ``noise_signal``: each DP-SGD client's per-round noise/signal read back from the lines its own log
holds (written by the plugin's own text), and the report's per-client median over the last quarter of the rounds."""

from __future__ import annotations

from fs_fedpa.fs_results import read_noise_signal
from fs_fedpa.plugin.privacy import signal_noise_text
from fs_fedpa.study.report_dp_regime import noise_shares


def _line(client: int, signal: float, noise: float, extra: str = "") -> str:
    head = (f"2026-11-29 02:09:53,942 (privacy:229) INFO: [fedpa] client #{client}: DP-SGD epsilon 2.915 at delta "
            f"1e-05 after 1 steps (n=8214, b=256 expected, z=0.6156, C=0.1; poisson sampling, pld){extra}")
    return head + signal_noise_text((signal, noise)) + "\n"


def test_each_clients_noise_over_signal_is_read_in_round_order(tmp_path):
    lines = [
        _line(10, 3.219, 6.831),
        "2026-11-29 02:09:54 (client:123) INFO: {'Role': 'Client #10', 'Round': 0}\n",  # not a DP-SGD line
        _line(2, 7.56, 6.148, "; 2 steps drew no record (Poisson) and were noise alone"),
        _line(10, 4.0, 2.0),
        _line(2, 0.0, 6.0),  # an empty round: no signal
    ]
    (tmp_path / "exp_print.log").write_text("".join(lines))
    found = read_noise_signal(tmp_path)
    assert found == {"10": [2.12, 0.5], "2": [0.813, None]}  # 6.831 / 3.219 = 2.122..., 6.148 / 7.56 = 0.8132...
    assert read_noise_signal(tmp_path / "missing") == {}


def test_the_report_takes_each_clients_median_over_its_last_quarter():
    run = {"noise_signal": {"1": [9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 1.0, 3.0], "2": [5.0, 5.0, 5.0, 5.0, None, None, None,
                                                                                   None]}}  # fmt: skip
    # client 1: median of its last 2 rounds (1, 3) = 2; client 2: its last 2 have no signal, so it is left out
    assert noise_shares(run) == [2.0]
    assert noise_shares({}) == []
