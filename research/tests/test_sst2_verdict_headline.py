"""The headline figure's rows: FedPA-LoRA − FedIT, one a main setting, each the verdict table's own interval."""

from __future__ import annotations

from pathlib import Path

from research.study import protocol_results as pr
from research.study import sst2_verdict as sv

REPORT = Path(__file__).resolve().parents[2] / "docs" / "reference" / "sst2_protocol"


def test_the_headline_is_at_most_eight_plain_rows_each_the_verdicts_fedpa_minus_fedit():
    results = pr.load_results(REPORT)
    rows = sv.headline_rows(results)
    assert 1 <= len(rows) <= 8 and len({r["label"] for r in rows}) == len(rows)
    full = {(r["setting"], r["against"]): r["val_acc"] for r in sv.verdict_rows(results) if "val_acc" in r}
    for row, (label, setting, against) in zip(rows, sv.HEADLINE):
        assert row["label"] == label and row["val_acc"] == full[(setting, against)]
        assert "fedit" in against.lower() or against.startswith("arm") and "FedIT" in setting
        assert "_" not in label  # plain words, no cell names
    main = rows[0]["val_acc"]  # the README's main-cell interval
    assert (round(100 * main["mean"], 1), round(100 * main["low"], 1)) == (-1.2, -2.3)
