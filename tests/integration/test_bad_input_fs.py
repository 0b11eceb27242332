"""Bad input fails through FederatedScope's own main before any training, with the message of docs/errors.md.

CASES is the table of docs/errors.md: a test checks that both list the same cases with the same messages.
"""

from __future__ import annotations

import os
import re
import site

import pytest

from tests.conftest import ROOT
from tests.integration.tiny_assets import fs_glue_yaml, run_fs

pytestmark = pytest.mark.integration

# (case, FS overrides on the tiny GLUE config, what stderr says); "{tmp}" is the test's folder
CASES = [
    ("unknown `fedpa` key", ["fedpa.rank", "4"], "Non-existent key: fedpa.rank"),
    ("λ < 0", ["fedpa.lam", "-1.0"], "fedpa.lam(=-1.0) must be a finite number >= 0"),
    ("λ > 1e6", ["fedpa.lam", "1e300"], "fedpa.lam(=1e+300) must be <= 1e+06"),
    (
        "`seed` > 2**32 − 1",
        ["fedpa.seed", str(10**23)],
        "fedpa.seed(=100000000000000000000000) must be <= 2**32 - 1",
    ),
    ("no round to train", ["federate.total_round_num", "0"], "federate.total_round_num(=0) must be an int >= 1"),
    ("unknown `reg`", ["fedpa.reg", "l2"], "fedpa.reg(='l2') must be one of ('product', 'b', 'a', 'both', 'none')"),
    ("unknown `svd`", ["fedpa.svd", "qr"], "fedpa.svd(='qr') must be one of ('reduced', 'randomized', 'dense')"),
    ("unknown `adaptive_lam`", ["fedpa.adaptive_lam", "cos"], "fedpa.adaptive_lam(='cos') must be one of"),
    ("`oversample` < 0", ["fedpa.oversample", "-1"], "fedpa.oversample(=-1) must be an int >= 0"),
    (
        "`client_ranks` of the wrong length",
        ["fedpa.client_ranks", "[2, 4]"],
        "fedpa.client_ranks has 2 values for federate.client_num(=3) clients",
    ),
    ("`client_ranks` value ≤ 0", ["fedpa.client_ranks", "[2, 0, 4]"], "fedpa.client_ranks[1](=0) must be an int >= 1"),
    (
        "`reference_ranks` of the wrong length",
        ["fedpa.reference_ranks", "[2, 2, 2, 2]"],
        "fedpa.reference_ranks has 4 values for federate.client_num(=3) clients",
    ),
    ("`reference_ranks` value ≤ 0", ["fedpa.reference_ranks", "[-1, 2, 2]"], "fedpa.reference_ranks[0](=-1)"),
    (
        "R_g = max R_i larger than a layer (R_i > d)",
        ["fedpa.reference_ranks", "[64, 2, 2]"],
        "global rank R_g(=64) > min(d, k)(=32)",
    ),
    ("r_i larger than a layer", ["fedpa.client_ranks", "[64, 4, 4]"], "client rank r_g(=64) > min(d, k)(=32)"),
    (
        "factor-wise `reg` (b, a, both) with R_i ≠ r_i",
        ["fedpa.reg", "b", "fedpa.reference_ranks", "[2, 2, 2]"],
        "fedpa.reg 'b' compares factors, so it needs reference_ranks == client_ranks",
    ),
    ("`fedrot_lora.strength` outside [0, 1]", ["fedpa.fedrot_lora.strength", "2.0"], "must be in [0, 1]"),
    ("more threads than CPUs", ["fedpa.num_threads", "100000"], "fedpa.num_threads(=100000) > the"),
    (
        "`group_sizes` without ranks",
        ["fedpa.group_sizes", "[1, 2]"],
        "fedpa.group_sizes [1, 2] is set but neither fedpa.client_ranks nor fedpa.reference_ranks is",
    ),
    (
        "`local_param` naming no parameter",
        ["personalization.local_param", "['clasifier']"],
        "personalization.local_param ['clasifier'] matches no parameter of the model",
    ),
    ("an FS feature FedPA does not speak", ["federate.use_ss", "True"], "does not support secret sharing"),
    ("half-precision training on the CPU", ["train.is_enable_half", "True"], "train.is_enable_half True on the CPU"),
    ("more clients than `max_clients`", ["federate.client_num", "1000000"], "is above fedpa.max_clients(=10000)"),
    (
        "`eval.refit_head` without a local head",
        ["fedpa.eval.refit_head", "True", "personalization.local_param", "[]"],
        "fedpa.eval.refit_head refits a sequence classifier's local head",
    ),
    (
        "missing GLUE file",
        ["data.root", "{tmp}/no_glue"],
        "GLUE sst2 train: {tmp}/no_glue/SST-2/train.tsv does not exist",
    ),
    ("unknown GLUE task", ["data.type", "sst3@glue"], "unknown GLUE task 'sst3'"),
    ("model path that does not exist", ["model.type", "/no/such/model@seqcls_llm"], "model path '/no/such/model'"),
    ("a `fedpa` yaml without the plugin installed", ["--no-plugin"], "Non-existent config key: model.seqcls"),
]


@pytest.mark.parametrize("case,opts,message", CASES, ids=[c for c, _, _ in CASES])
def test_bad_input_fails_before_training_with_its_message(tiny_glue, tmp_path, case, opts, message):
    cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"])
    opts = [o.replace("{tmp}", str(tmp_path)) for o in opts]
    kwargs = {}
    if opts == ["--no-plugin"]:  # `python -S` skips site processing, so fs_fedpa.pth never runs
        opts, kwargs = [], {"python_args": ["-S"], "env": {"PYTHONPATH": os.pathsep.join(site.getsitepackages())}}
    proc = run_fs(cfg, tmp_path, extra_opts=opts, timeout=120, **kwargs)
    assert proc.returncode != 0, case
    assert message.replace("{tmp}", str(tmp_path)) in proc.stderr, proc.stderr[-3000:]
    assert "Starting training" not in proc.stdout + proc.stderr  # failed before any round


def test_docs_table_lists_exactly_these_cases():
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in (ROOT / "docs" / "errors.md").read_text().split("## Faulty client updates")[0].splitlines()
        if line.startswith("| ") and not line.startswith("| case")
    ]
    assert [r[0] for r in rows] == [c for c, _, _ in CASES]
    for (case, _, message), row in zip(CASES, rows):
        shown = re.sub(r"`", "", row[-1])
        assert message.replace("{tmp}/no_glue", "<data.root>") in shown, case
