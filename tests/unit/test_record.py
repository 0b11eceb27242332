"""The diagnostics record: the one type behind the server's file, the comparison's table and the docs."""

from __future__ import annotations

import json
import re

import pytest

from fs_fedpa.record import CLIENT_STATS, RoundRecord, compact, describe
from tests.conftest import ROOT


def test_docs_table_lists_every_record_field_with_its_meaning():
    text = (ROOT / "docs" / "dev" / "plugin.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_A-Z]+)` \| (.+) \|$", text, flags=re.M))
    fields = dict(describe())
    assert set(fields) <= set(rows)
    assert all(rows[k] == fields[k] for k in fields)


def test_client_stats_are_kept_per_client_and_summarised():
    # Prepare
    record = RoundRecord(round=3)
    stats = [
        {"delta_norm": 2.0, "drift": 1.0, "lam": 0.5, "grad_ratio_last": 0.1},
        {"delta_norm": 4.0, "drift": 3.0, "drift_rel": 0.5, "lam": 0.5, "grad_ratio_last": float("inf")},
    ]
    # Execute
    record.add_client_stats([7, 9], stats)
    # Assert
    assert record.delta_norm == {"7": 2.0, "9": 4.0}
    assert record.drift_rel == {"9": 0.5}
    assert record.grad_ratio_last == {"7": 0.1}  # a non-finite ratio is not averaged
    assert record.spread["delta_norm"] == [3.0, 1.0, 2.0, 4.0]  # mean, std, min, max
    assert "grad_ratio_first" not in record.spread


def test_compact_keeps_scalars_and_client_means():
    record = RoundRecord(round=1, e_agg=0.5, bytes_up_total=10, bytes_down_total=5)
    record.add_client_stats([1, 2], [{"drift": 1.0, "e_init_B": 0.2}, {"drift": 3.0, "e_init_B": 0.4}])
    out = compact(record.to_dict())
    assert out["round"] == 1 and out["e_agg"] == 0.5 and out["bytes_total"] == 15
    assert out["drift_mean"] == 2.0 and out["e_init_B"] == pytest.approx(0.3) and out["e_init_A"] is None
    assert "delta_norm_mean" not in out  # no client reported it
    assert "drift" in CLIENT_STATS


def test_compact_keeps_each_returning_clients_staleness_and_start_drift_as_a_pair():
    record = RoundRecord(round=9)
    stats = [{"staleness": 7, "drift_start": 0.5}, {}, {"staleness": 2, "drift_start": float("nan")},
             {"staleness": 3, "drift_start": 1.5}]  # fmt: skip
    record.add_client_stats([12, 3, 5, 10], stats)  # client 3 trains for the first time; 5's drift overflowed
    out = compact(record.to_dict())
    assert out["stale_drift"] == [[3, 1.5], [7, 0.5]]  # by client id: 10, then 12
    assert out["staleness_mean"] == 4.0 and out["drift_start_mean"] == 1.0
    assert "stale_drift" not in compact(RoundRecord(round=0).to_dict())  # full participation: nothing to pair


def test_compact_keeps_the_clients_lambda_range_for_the_adaptive_rules():
    record = RoundRecord(round=2)
    record.add_client_stats([1, 2, 3], [{"lam": 0.004}, {"lam": 0.01}, {"lam": 10.0}])
    out = compact(record.to_dict())
    assert out["lam_mean"] == pytest.approx((0.004 + 0.01 + 10.0) / 3)
    assert (out["lam_min"], out["lam_max"]) == (0.004, 10.0)
    assert "lam_mean" not in compact(RoundRecord(round=2).to_dict())  # no client reported one


def test_a_non_finite_diagnostic_is_written_as_null_and_named():
    # Prepare: what a legal but huge upload does to the server's diagnostics and to a client's gradient ratio
    record = RoundRecord(round=2, e_agg=float("inf"), e_agg_rel=float("nan"), spectrum_probe=[3.0, float("inf")])
    record.add_client_stats([1, 2], [{"grad_ratio_first": None, "alignment_loss": float("inf")}, {"drift": 2.0}])
    # Execute
    written = json.loads(json.dumps(record.to_dict(), allow_nan=False))  # standard JSON: no NaN, no Infinity
    # Assert
    assert written["e_agg"] is None and written["e_agg_rel"] is None and written["spectrum_probe"] == [3.0, None]
    assert record.not_finite() == ["e_agg", "e_agg_rel", "spectrum_probe"]
    assert written["nonfinite_stats"] == {"1": ["alignment_loss", "grad_ratio_first"]}
    assert written["alignment_loss"] == {"2": 0.0} and written["drift"] == {"2": 2.0}
