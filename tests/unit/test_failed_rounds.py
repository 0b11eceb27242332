"""fedpa.max_failed_rounds counts on the aggregator's own state; after a resume it counts on from the saved history's
trailing rounds without an aggregation (tests/integration/test_reliability_fs.py runs the stop itself)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip(
    "federatedscope", reason="FederatedScope is not installed: the server's round log is NOT checked "
    "(pip install --no-deps ../shared/vendor/FederatedScope-llm-*.tar.gz)"
)  # fmt: skip


def _record(rnd: int, clients: list[int]) -> dict:
    return {"round": rnd, "clients": clients, "bytes_up": {str(c): 10 for c in clients}, "bytes_down": {"1": 5},
            "e_agg": None, "e_agg_rel": None, "alignment_loss_mean": None}  # fmt: skip


def test_a_resume_counts_the_trailing_rounds_without_an_aggregation(tmp_path):
    from fs_fedpa.plugin.record_fs import RoundLog

    log = RoundLog(str(tmp_path), diagnostics=False)
    log.restore([_record(0, [1, 2]), _record(1, []), _record(2, [3]), _record(3, []), _record(4, [])], {"up": 30})
    assert log.failed_in_a_row() == 2
    log.restore(log.records[:3], {})
    assert log.failed_in_a_row() == 0
    log.restore([_record(r, []) for r in range(4)], {})
    assert log.failed_in_a_row() == 4


def test_the_round_log_adds_the_byte_totals_and_writes_one_line_a_round_only_with_diagnostics(tmp_path):
    from fs_fedpa.plugin.record_fs import RoundLog
    from fs_fedpa.record import DIAGNOSTICS_FILE

    log = RoundLog(str(tmp_path), diagnostics=True)
    log.add(_record(0, [1, 2]))
    log.add(_record(1, [1]))
    lines = [json.loads(x) for x in (tmp_path / DIAGNOSTICS_FILE).read_text().splitlines()]
    assert [(x["bytes_up_total"], x["bytes_down_total"]) for x in lines] == [(20, 5), (30, 10)]
    quiet = RoundLog(str(tmp_path / "quiet"), diagnostics=False)
    quiet.add(_record(0, [1]))
    assert quiet.records[0]["bytes_up_total"] == 10 and not (tmp_path / "quiet").exists()


def test_a_new_aggregator_has_no_failed_round():
    from fs_fedpa.plugin.aggregator import FedPAAggregator

    assert FedPAAggregator(method=None, rounds=None).failed_in_a_row == 0
