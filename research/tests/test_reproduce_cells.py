"""research/scripts/reproduce_cells.py: the harness that checks a change moves no bit of the committed SST-2 runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _harness():
    script = ROOT / "research" / "scripts" / "reproduce_cells.py"
    spec = importlib.util.spec_from_file_location("reproduce_cells", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_harness_reruns_the_committed_cells_as_the_protocol_ran_them_for_three_rounds():
    h = _harness()
    runs = h.runs(list(h.CELLS))
    assert sorted(r.name for r in runs) == sorted(["fedpa", "fedit", "fedsa_lora", "feddpa_t", "flora"])
    assert runs[0].name == "fedpa"
    committed = json.loads((ROOT / "docs/reference/sst2_protocol/runs/final/fedpa_s0.json").read_text())
    for run in runs:
        opts = dict(zip(run.cell().opts[::2], run.cell().opts[1::2]))
        assert opts["federate.total_round_num"] == "3" and opts["fedpa.num_threads"] == "1"
        assert opts["eval.freq"] == "3" and run.seed == 0
    fedpa = dict(zip(runs[0].opts[::2], runs[0].opts[1::2]))
    assert all(fedpa[k] == v for k, v in zip(committed["opts"][::2], committed["opts"][1::2]) if k in fedpa)


def test_the_harness_reports_every_field_that_differs_and_nothing_else():
    h = _harness()
    old = {"rounds": {2: {"val_acc": 0.8, "val_loss": float("nan")}, 5: {"val_acc": 0.9}},
           "diagnostics": [{"round": 0, "e_agg": 1.0}, {"round": 1, "e_agg": 2.0}, {"round": 2, "e_agg": 3.0},
                           {"round": 3, "e_agg": 4.0}]}  # fmt: skip
    new = json.loads(json.dumps(old).replace("NaN", "NaN"))
    new["rounds"] = {2: {"val_acc": 0.8, "val_loss": float("nan")}}  # later rounds are not compared
    new["diagnostics"] = new["diagnostics"][:3]
    assert h.differences(old, new) == []
    new["rounds"][2]["val_acc"] = 0.8000000001
    new["diagnostics"][1]["e_agg"] = 2.5
    new["diagnostics"][2]["extra"] = 1
    assert h.differences(old, new) == [
        (2, "eval:val_acc", 0.8, 0.8000000001),
        (1, "diag:e_agg", 2.0, 2.5),
        (2, "diag:extra", None, 1),
    ]
    # a diagnostic this code adds is not counted where only the new run has it; a change to one both have still is
    assert h.differences(old, new, added=("extra",)) == [
        (2, "eval:val_acc", 0.8, 0.8000000001),
        (1, "diag:e_agg", 2.0, 2.5),
    ]
    assert (1, "diag:e_agg", 2.0, 2.5) in h.differences(old, new, added=("e_agg",))


def test_against_compares_with_an_earlier_calls_outputs_and_refuses_its_own_work_folder(tmp_path):
    import pytest

    h = _harness()
    with pytest.raises(SystemExit, match="no cell's FS output"):
        h.reference_runs(tmp_path)
    with pytest.raises(SystemExit):  # argparse's error: --work would delete the baseline it compares with
        h.main(["--data", str(tmp_path), "--work", str(tmp_path / "b"), "--against", str(tmp_path / "b")])
