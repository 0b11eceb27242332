"""fedpa.max_failed_rounds counts on the aggregator's own state, which a resume point carries (its state_dict)
(tests/integration/test_reliability_fs.py runs the stop itself)."""

from __future__ import annotations

import json

import pytest

from fs_fedpa.config_sections import RecordsConfig

pytest.importorskip(
    "federatedscope", reason="FederatedScope is not installed: the server's round log is NOT checked "
    "(pip install --no-deps ../shared/vendor/FederatedScope-llm-*.tar.gz)"
)  # fmt: skip


def _record(rnd: int, clients: list[int]) -> dict:
    return {"round": rnd, "clients": clients, "bytes_up": {str(c): 10 for c in clients}, "bytes_down": {"1": 5},
            "e_agg": None, "e_agg_rel": None, "alignment_loss_mean": None}  # fmt: skip


def test_the_aggregators_count_and_generator_travel_in_its_state_dict_not_in_the_records(tmp_path):
    import torch

    from fs_fedpa.plugin.aggregator import FedPAAggregator
    from fs_fedpa.plugin.record_fs import RoundLog

    log = RoundLog(str(tmp_path), RecordsConfig(diagnostics="off"))
    # the history ends in a round without clients that did aggregate (a client-level DP release of a Poisson draw
    # of no client): a count recomputed from the records would call it failed
    for record in (_record(0, [1]), _record(1, [])):
        log.add(record)
    before = FedPAAggregator(method=None, round_log=log, generator=torch.Generator().manual_seed(3))
    before.failed_in_a_row = 0
    torch.rand(4, generator=before.generator)
    state = before.state_dict()
    after = FedPAAggregator(method=None, round_log=log, generator=torch.Generator().manual_seed(99))
    after.failed_in_a_row = 7
    after.check_state(state, "p.pt", 2)
    after.load_state_dict(state, "p.pt")
    assert after.failed_in_a_row == 0
    assert torch.equal(torch.rand(4, generator=after.generator), torch.rand(4, generator=before.generator))
    again = RoundLog(str(tmp_path / "again"), RecordsConfig(diagnostics="off"))
    again.check_state(log.state_dict(), "p.pt", 2)
    again.load_state_dict(log.state_dict(), "p.pt")
    assert again.clients == log.clients == {1} and again.totals == {"up": 10, "down": 10}


def test_the_round_log_adds_the_byte_totals_and_writes_one_line_a_round_only_with_diagnostics(tmp_path):
    from fs_fedpa.plugin.record_fs import RoundLog
    from fs_fedpa.record import DIAGNOSTICS_FILE

    log = RoundLog(str(tmp_path), RecordsConfig(diagnostics="full"))
    log.add(_record(0, [1, 2]))
    log.add(_record(1, [1]))
    lines = [json.loads(x) for x in (tmp_path / DIAGNOSTICS_FILE).read_text().splitlines()]
    assert [(x["bytes_up_total"], x["bytes_down_total"]) for x in lines] == [(20, 5), (30, 10)]
    quiet = RoundLog(str(tmp_path / "quiet"), RecordsConfig(diagnostics="off"))
    record = _record(0, [1])
    quiet.add(record)
    assert record["bytes_up_total"] == 10 and not (tmp_path / "quiet").exists()
    light = RoundLog(str(tmp_path / "light"), RecordsConfig(diagnostics="light"))
    (tmp_path / "light").mkdir()
    light.add(_record(0, [1]))
    assert json.loads((tmp_path / "light" / DIAGNOSTICS_FILE).read_text())["bytes_up_total"] == 10


def test_a_new_aggregator_has_no_failed_round():
    from fs_fedpa.plugin.aggregator import FedPAAggregator

    assert FedPAAggregator(method=None, round_log=None).failed_in_a_row == 0
