"""fs_fedpa.outcomes: the clients' shards of the evaluation file by identity of the examples FS hands them, and the
outcome lines, read back as JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

from fs_fedpa.outcomes import append_outcomes, write_eval_shards
from fs_fedpa.record import EVAL_SHARDS_FILE, OUTCOMES_FILE


def test_shards_are_the_indices_of_each_clients_examples_in_the_evaluation_file(tmp_path):
    evaluation = [(f"sentence {i}", i % 2) for i in range(6)]  # equal tuples would still be other objects
    train = [("train", 0), ("train", 1)]
    data = {
        0: SimpleNamespace(val_data=list(evaluation)),  # the server's whole copy: never a shard
        1: SimpleNamespace(train_data=train, val_data=[evaluation[4], evaluation[1]]),
        2: SimpleNamespace(train_data=train, val_data=[evaluation[0]], test_data=[("not from the file", 1)]),
    }
    write_eval_shards(str(tmp_path / "run"), data, evaluation)
    written = json.loads((tmp_path / "run" / EVAL_SHARDS_FILE).read_text())
    assert written == {"size": 6, "splits": {"val": {"1": [4, 1], "2": [0]}}}


def test_outcomes_append_one_line_per_protocol_and_split(tmp_path):
    append_outcomes(str(tmp_path), {"global": {"val": "0110"}}, 0, 3)
    append_outcomes(str(tmp_path), {"global": {"val": "1110", "test": "1"}, "local": {"val": "0000"}}, 1, 3)
    lines = [json.loads(line) for line in (tmp_path / OUTCOMES_FILE).read_text().splitlines()]
    assert lines == [
        {"round": 0, "client": 3, "protocol": "global", "split": "val", "correct": "0110"},
        {"round": 1, "client": 3, "protocol": "global", "split": "val", "correct": "1110"},
        {"round": 1, "client": 3, "protocol": "global", "split": "test", "correct": "1"},
        {"round": 1, "client": 3, "protocol": "local", "split": "val", "correct": "0000"},
    ]
