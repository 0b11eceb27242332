"""The GLUE reader on tiny directories written here (quoting, columns, labels, errors) and, opt-in, on real GLUE."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

from fs_fedpa.tasks.glue import GLUE_TASKS, default_eval_split, get_task, load_glue

REAL = Path(__file__).resolve().parents[4] / "shared" / "data" / "glue"


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_sst2_rows_labels_and_trailing_spaces(tmp_path):
    _write(tmp_path / "SST-2" / "train.tsv", ["sentence\tlabel", "a fine film \t1", 'the " lone quote \t0'])
    examples = load_glue("SST-2", tmp_path, "train")
    assert [(e.text_a, e.text_b, e.label) for e in examples] == [
        ("a fine film", None, 1),
        ('the " lone quote', None, 0),
    ]


def test_sentence_pairs_with_index_column_and_leading_quote(tmp_path):
    # Prepare: RTE's layout; a field that starts with a lone quote breaks CSV quoting
    _write(
        tmp_path / "RTE" / "dev.tsv",
        [
            "index\tsentence1\tsentence2\tlabel",
            '0\t"Quoted start, no end.\tHyp one.\tentailment',
            "1\tPremise.\tHyp two.\tnot_entailment",
        ],
    )
    # Execute
    examples = load_glue("rte", tmp_path, "validation")
    # Assert
    assert [(e.text_a, e.text_b, e.label) for e in examples] == [
        ('"Quoted start, no end.', "Hyp one.", 0),
        ("Premise.", "Hyp two.", 1),
    ]


def test_cola_without_header_and_mnli_eval_splits(tmp_path):
    _write(tmp_path / "CoLA" / "train.tsv", ["src\t1\t\tGood sentence .", "src\t0\t*\tBad sentence ."])
    assert [(e.text_a, e.label) for e in load_glue("cola", tmp_path)] == [
        ("Good sentence .", 1),
        ("Bad sentence .", 0),
    ]
    header = "index\tpromptID\tpairID\tgenre\tsentence1\tsentence2\tgold_label"
    _write(tmp_path / "MNLI" / "dev_mismatched.tsv", [header, "0\t1\t2\tfic\tP.\tH.\tcontradiction"])
    assert default_eval_split("mnli") == "validation_matched"
    assert load_glue("mnli", tmp_path, "validation_mismatched")[0].label == 2


def test_limit_keeps_the_first_rows(tmp_path):
    _write(tmp_path / "SST-2" / "train.tsv", ["sentence\tlabel", *[f"s{i}\t{i % 2}" for i in range(10)]])
    assert [e.text_a for e in load_glue("sst2", tmp_path, limit=3)] == ["s0", "s1", "s2"]


@pytest.mark.parametrize(
    "lines,match",
    [
        (["sentence\tlabel", "ok\t2"], r"train.tsv, line 2: label '2' is not one of \['0', '1'\]"),
        (["sentence\tlabel", "ok\t1", "too\tmany\tfields"], r"train.tsv, line 3: 3 fields, expected 2"),
        (["text\tlabel", "ok\t1"], r"lacks columns \['sentence'\]"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path, lines, match):
    _write(tmp_path / "SST-2" / "train.tsv", lines)
    with pytest.raises(ValueError, match=match):
        load_glue("sst2", tmp_path)


def test_offline_without_files_names_the_expected_files(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # importing datasets now fails
    with pytest.raises(FileNotFoundError) as err:
        load_glue("sst2", tmp_path, "validation")
    message = str(err.value)
    assert str(tmp_path / "SST-2" / "dev.tsv") in message and "Hugging Face datasets could not provide it" in message


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: get_task("glue9"), r"unknown GLUE task 'glue9'"),
        (
            lambda: load_glue("sst2", None, "test"),
            r"split 'test' of GLUE sst2: choose one of \['train', 'validation'\]",
        ),
        (lambda: load_glue("sst2", None, limit=0), r"limit\(=0\) must be a positive int"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_task_table():
    assert {"sst2", "qnli", "qqp", "rte", "mnli"} <= set(GLUE_TASKS)
    assert get_task("MNLI").num_labels == 3 and get_task("stsb").num_labels == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "task,split,counts",
    [
        ("sst2", "train", {0: 29780, 1: 37569}),
        ("sst2", "validation", {0: 428, 1: 444}),
        ("rte", "train", {0: 1249, 1: 1241}),
        ("rte", "validation", {0: 146, 1: 131}),
        ("qnli", "validation", {0: 2702, 1: 2761}),
    ],
)
def test_real_glue_files_have_the_published_label_counts(task, split, counts):
    if not REAL.is_dir():
        pytest.skip(f"no real GLUE data at {REAL}")
    examples = load_glue(task, REAL, split, allow_download=False)
    assert dict(collections.Counter(e.label for e in examples)) == counts


# ------------------------------------------------------------------------------------- held-out validation
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fs_fedpa.tasks.glue import holdout_size, holdout_split  # noqa: E402


@given(
    st.integers(0, 3000),
    st.one_of(st.just(0.0), st.floats(0.001, 0.999), st.integers(1, 5000).map(float)),
    st.integers(1, 50),
)
def test_the_held_out_part_is_disjoint_covers_the_shard_and_repeats(n, holdout, client):
    train, held = holdout_split(n, holdout, client)
    assert sorted(train + held) == list(range(n)) and not set(train) & set(held)
    assert len(held) == holdout_size(n, holdout) and (len(train) >= 1 or n == 0)
    assert (train, held) == holdout_split(n, holdout, client)  # the same examples in every run, method and seed


def test_holdout_sizes_by_hand():
    assert holdout_size(6424, 0.015) == 96 and holdout_size(634, 0.015) == 10  # two SST-2 shards of the protocol
    assert holdout_size(10, 0.01) == 1 and holdout_size(10, 3) == 3 and holdout_size(10, 50) == 9
    assert holdout_size(1, 0.5) == 0 and holdout_size(100, 0) == 0
    with pytest.raises(ValueError, match="glue_holdout"):
        holdout_size(10, -0.1)


def test_clients_hold_out_different_positions():
    assert holdout_split(1000, 0.05, 1)[1] != holdout_split(1000, 0.05, 2)[1]
