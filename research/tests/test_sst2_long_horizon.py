"""Issue 31's stages of the SST-2 protocol (the head asymmetry and the long horizon), the per-sentence outcomes they
store and the report's sections on them, on fabricated results; the FS side is tests/integration's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from research.harness import compare
from research.study import protocol_results as pr
from research.study import sst2_protocol as sp
from fs_fedpa.record import EVAL_SHARDS_FILE, OUTCOMES_FILE

COMMITTED = Path(__file__).resolve().parents[2] / sp.REPORT
SHARDS = {"1": [0, 2, 4, 6, 8, 10], "2": [1, 3, 5, 7, 9, 11]}  # a dev set of 12 sentences, two clients


def _opts(run: sp.Run) -> dict[str, str]:
    return dict(zip(run.opts[::2], run.opts[1::2]))


def test_the_new_stages_run_exactly_what_the_issue_fixed_before_the_runs():
    selected = json.loads((COMMITTED / "selected.json").read_text())
    long = sp.long_runs(selected)
    assert [(r.name, r.seed) for r in long[:4]] == [(a, 0) for a, _, _ in sp.LONG_ARMS]  # seed-major
    assert {r.seed for r in long} == {0, 1, 2, 3} and len(long) == 16 and {r.rounds for r in long} == {60}
    arms = {r.name: _opts(r) for r in long}
    expected = {
        "fedit": ("AdamW", "0.005", None),
        "fedpa": ("AdamW", "0.002", "0.01"),
        "fedpa_adamw5e-3_lam1": ("AdamW", "0.005", "1"),
        "fedpa_adamw5e-3_lam0.1": ("AdamW", "0.005", "0.1"),
    }
    for name, (optimizer, lr, lam) in expected.items():
        o = arms[name]
        assert (o["train.optimizer.type"], o["train.optimizer.lr"], o.get("fedpa.lam")) == (optimizer, lr, lam)
        assert o["fedpa.save_outcomes"] == "True" and o["fedpa.num_threads"] == "1"
        assert o["data.glue_holdout"] == "0" and o["fedpa.eval_local"] == "True"
    head = sp.head_runs(selected, selected["T"])
    assert [r.seed for r in head] == [0, 1, 2, 3, 4] and {r.rounds for r in head} == {selected["T"]}
    o = _opts(head[0])
    assert head[0].method == "fedit" and o["personalization.local_param"] == "[]"
    assert (o["train.optimizer.type"], o["train.optimizer.lr"]) == ("AdamW", "0.005")


def _write_outputs(folder: Path, evaluations: dict[int, dict[str, dict[str, str]]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EVAL_SHARDS_FILE).write_text(json.dumps({"size": 12, "splits": {"val": SHARDS}}))
    lines = [
        {"round": r, "client": int(c), "protocol": p, "split": "val", "correct": bits}
        for r, protocols in evaluations.items()
        for p, clients in protocols.items()
        for c, bits in clients.items()
    ]
    (folder / OUTCOMES_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))


def _bits(rng: random.Random, p: float) -> dict[str, str]:
    return {c: "".join("1" if rng.random() < p else "0" for _ in idx) for c, idx in SHARDS.items()}


def test_read_outcomes_keeps_the_last_evaluations_and_refuses_a_bad_file(tmp_path):
    rng = random.Random(0)
    evaluations = {r: {"global": _bits(rng, 0.8), "local": _bits(rng, 0.7)} for r in (2, 5, 8, 11)}
    _write_outputs(tmp_path, evaluations)
    got = compare.read_outcomes(tmp_path)
    assert got["size"] == 12 and got["split"] == "val" and got["shards"] == SHARDS
    assert got["rounds"] == {r: evaluations[r] for r in (5, 8, 11)}
    assert compare.read_outcomes(tmp_path / "nothing") is None
    evaluations[11]["global"]["2"] = "0101"  # a client's outcomes do not match its shard
    _write_outputs(tmp_path, evaluations)
    with pytest.raises(ValueError, match="client 2: 4 outcomes for a shard of 6"):
        compare.read_outcomes(tmp_path)


def _long_run(cell: str, seed: int, p: float, rounds=(53, 56, 59), rng=None) -> dict:
    """A fabricated long-horizon run whose val_acc at each stored evaluation is its outcomes' share of 1s."""
    rng = rng or random.Random(hash((cell, seed)) % 1000)
    evaluations = {r: {"global": _bits(rng, p), "local": _bits(rng, p - 0.1)} for r in rounds}
    metrics = {}
    for r, protocols in evaluations.items():
        share = {k: sum(b.count("1") for b in v.values()) / 12 for k, v in protocols.items()}
        metrics[r] = {"val_acc": share["global"], "local.val_acc": share["local"]}
    early = {2: {"val_acc": 0.6 + 0.01 * seed, "local.val_acc": 0.5}, 20: {"val_acc": 0.7, "local.val_acc": 0.6}}
    return {
        "cell": cell,
        "method": cell.split("_")[0],
        "seed": seed,
        "seconds": 1.0,
        "rounds": {**early, **metrics},
        "diagnostics": [],
        "outcomes": {"size": 12, "split": "val", "shards": SHARDS, "rounds": evaluations},
    }


def test_sentence_scores_average_to_the_endpoint():
    run = _long_run("fedpa", 0, 0.7)
    for protocol_name, metric in (("global", "val_acc"), ("local", "local.val_acc")):
        scores, clients = pr.sentence_scores(run, protocol_name)
        assert clients == [1, 2] * 6
        assert sum(scores) / len(scores) == pytest.approx(sp.endpoint(run, metric))
    assert sp.endpoint(run, "val_acc", k=4) is None or len(run["rounds"]) >= 4


def _results_with_long_runs(p_arm: float) -> dict:
    results = {}
    for seed in (0, 1, 2):
        for cell, _, _ in sp.LONG_ARMS:
            p = 0.8 if cell == sp.LONG_REFERENCE else p_arm
            results[f"long/{cell}_s{seed}"] = _long_run(cell, seed, p)
        for cell in ("fedit", "fedpa"):  # the committed final runs of the same seeds: rounds 2 and 20
            results[f"final/{cell}_s{seed}"] = {**_long_run(cell, seed, 0.8), "rounds": dict(
                list(results[f"long/{cell}_s{seed}"]["rounds"].items())[:2])}  # fmt: skip
    return results


def test_the_long_horizon_section_states_endpoints_both_intervals_and_the_reproduction(tmp_path, monkeypatch):
    from research.study import plots
    from research.study.report_long import long_section

    monkeypatch.setattr(plots, "plot_protocols", lambda *args: None)  # the figures are test_plots.py's
    results = _results_with_long_runs(0.6)
    text = "\n".join(long_section(results, tmp_path))
    assert "every one equal" in text and "(24 values)" in text  # 3 seeds x 2 arms x 2 rounds x 2 protocols
    endpoints = [line for line in text.splitlines() if line.startswith("| fed") and " ± " in line]
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in endpoints}
    assert set(rows) == {"fedit", "fedpa", "fedpa_adamw5e-3_lam1", "fedpa_adamw5e-3_lam0.1"}
    assert rows["fedit"][3] == "–"
    # the bootstrap's point estimate is the t interval's mean: both are the mean over seeds of the endpoint gap
    t_part, boot_part = rows["fedpa"][3].split("; Holm: ")[1].split("; ", 1)  # "ties (p 0.554); +0.0300 [...]"
    t_mean = float(rows["fedpa"][3].split(" ")[0])
    label, adjusted = t_part.split(" (p ")
    assert label in ("wins", "ties", "loses") and 0 <= float(adjusted.rstrip(")")) <= 1
    assert float(boot_part.split(" ")[0]) == pytest.approx(t_mean, abs=1e-4)
    assert boot_part.endswith("] n=3") and " n=3: arm " in rows["fedpa"][3]  # both over the 3 seed pairs
    gap = sum(sp.endpoint(results[f"long/fedpa_s{s}"], "val_acc") - sp.endpoint(results[f"long/fedit_s{s}"], "val_acc")
              for s in (0, 1, 2)) / 3  # fmt: skip
    assert t_mean == pytest.approx(gap, abs=1e-4)
    # a run that no longer reproduces its final run is named by its largest difference
    results["long/fedpa_s1"]["rounds"][20] = {"val_acc": 0.7 + 0.0125, "local.val_acc": 0.6}
    assert "largest difference 1.25e-02" in "\n".join(long_section(results, tmp_path))


def test_the_bootstrap_refuses_arms_whose_dev_shards_differ(tmp_path, monkeypatch):
    from research.study import plots
    from research.study.report_long import long_section

    monkeypatch.setattr(plots, "plot_protocols", lambda *args: None)
    results = _results_with_long_runs(0.6)
    results["long/fedpa_s0"]["outcomes"]["shards"] = {"1": SHARDS["2"], "2": SHARDS["1"]}
    with pytest.raises(ValueError, match="dev shards differ"):
        long_section(results, tmp_path)


def _final(cell: str, seed: int, acc: float, stage: str = "final") -> tuple[str, dict]:
    rounds = {20: {"val_acc": acc, "local.val_acc": acc - 0.01}}
    return f"{stage}/{cell}_s{seed}", {"cell": cell, "method": cell, "seed": seed, "rounds": rounds}


def test_the_head_section_pairs_each_comparison_on_its_shared_seeds():
    from research.study.report_verdict import head_section

    results = dict(
        [_final("fedpa", s, 0.88 + 0.001 * s) for s in range(5)]
        + [_final("fedit", s, 0.89 + 0.002 * s) for s in range(5)]
        + [_final("fedpa_no_local_head", s, 0.81 + 0.001 * s, "ablation") for s in range(3)]
        + [_final(sp.HEAD_CELL, s, 0.80 + 0.0015 * s, "head") for s in range(5)]
    )
    rows = [line.split(" | ") for line in head_section(results) if line.startswith("| FedPA") or "worth" in line]
    assert len(rows) == 3
    assert rows[0][1].startswith("+0.0790 [") and "n=5" in rows[0][1]  # mean over s of 0.08 - 0.0005 s
    assert "n=3" in rows[1][1] and rows[1][1].startswith("+0.0095 [")  # 0.01 - 0.0005 s over seeds 0-2
    assert rows[2][1].startswith("+0.0910 [") and "first wins" in rows[2][1]
    assert head_section({}) == ["## The head asymmetry: FedIT without a local head", "", "Not run yet.", ""]


def test_near_duplicates_and_holm_labels_per_family():
    results = dict(
        [_final("fedpa", s, 0.880) for s in range(3)]
        + [_final("fedit", s, 0.890 + 0.001 * s) for s in range(3)]
        + [_final("lora_fair", s, 0.893 - 0.001 * s) for s in range(3)]
        + [_final("flexlora", s, 0.880 + 0.01 * s) for s in range(3)]
    )
    assert pr.near_duplicates(results, sp.BASELINES) == [["fedit", "lora_fair"]]
    rows = pr.with_holm(pr.paired_rows(results, "val_acc"))
    assert set(rows) == {"fedit", "lora_fair", "flexlora"} and all("holm" in r and "p" in r for r in rows.values())
    assert rows["flexlora"]["holm"] == "ties"
