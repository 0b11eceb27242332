"""``fedpa.eval.refit_head``: each protocol scored with the classifier head refitted on the client's training split,
checked against scikit-learn's logistic regression on features recomputed from the exported adapters, and shown
to leave the run itself unchanged (tiny BERT on tiny SST-2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.test_export_fs import _base, _dev, _outcomes, _run
from tests.integration.tiny_assets import dump_yaml, read_eval_results, round_results

pytestmark = pytest.mark.integration


def _train_shards(tiny_glue, cfg: dict, tmp_path: Path) -> dict[int, list]:
    """client -> its training examples, from FS's split of the same config (deterministic: test_glue_fs)."""
    from federatedscope.core.auxiliaries.data_builder import get_data
    from federatedscope.core.configs.config import global_cfg

    fs_cfg = global_cfg.clone()
    fs_cfg.merge_from_file(dump_yaml(cfg, tmp_path / "split.yaml"))
    data, _ = get_data(fs_cfg.clone())
    return {cid: list(data[cid].train_data) for cid in range(1, cfg["federate"]["client_num"] + 1)}


def _head_inputs(model, examples) -> torch.Tensor:
    """The classifier's input for each example: BERT's pooled [CLS] state (an HF forward with hidden states)."""
    from fs_fedpa.plugin.seqcls import trim_padding

    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(examples), 8):
            batch = examples[start : start + 8]
            features = trim_padding({k: torch.stack([e[0][k] for e in batch]) for k in batch[0][0]})
            bert = model.get_base_model().bert if hasattr(model, "get_base_model") else model.bert
            out.append(bert(**features).pooler_output.float())
    return torch.cat(out)


def test_refitted_heads_score_what_sklearn_fits_and_change_nothing_else(tiny_glue, tmp_path):
    import numpy as np
    from sklearn.linear_model import LogisticRegression

    from fs_fedpa.export import load

    # a rate at which the heads stay near their random start, so a refitted head predicts otherwise
    slow = {"train.optimizer.lr": 1e-6}
    cfg, outdir = _run(tiny_glue, tmp_path / "refit", "fedpa", **slow, **{"fedpa.eval.refit_head": True})
    plain, plain_dir = _run(tiny_glue, tmp_path / "plain", "fedpa", **slow)
    # the run's own scores, at every round, are those of the run without the refit
    rows, plain_rows = round_results(read_eval_results(outdir)), round_results(read_eval_results(plain_dir))
    assert sorted(rows) == sorted(plain_rows) and rows
    last = max(rows)
    for rnd, metrics in rows.items():
        same = {k: v for k, v in metrics.items() if "refit" not in k}
        assert same == pytest.approx(plain_rows[rnd]), f"round {rnd}"
        assert any("refit" in k for k in metrics) == (rnd == last), f"round {rnd}: refit only after the last upload"
    # each client's refitted predictions are scikit-learn's fit on its training shard's head inputs
    dev = _dev(tiny_glue)
    shards = json.loads((outdir / "fedpa_eval_shards.json").read_text())["splits"]["val"]
    train = _train_shards(tiny_glue, cfg, tmp_path)
    outcomes = _outcomes(outdir)
    agree = total = differ = 0
    for protocol, unfitted_of, refit_of in (("paper", "global", "refit"), ("local", "local", "local.refit")):
        for client, indices in sorted(shards.items(), key=lambda kv: int(kv[0])):
            if not indices:
                continue
            model = load(_base(tiny_glue), tmp_path / "refit" / "at_end", client=int(client), protocol=protocol)
            X = _head_inputs(model, train[int(client)]).numpy()
            y = np.array([e[1] for e in train[int(client)]])
            examples = [dev[i] for i in indices]
            if len(set(y)) == 1:
                predicted = np.full(len(examples), y[0])
            else:  # binary: scikit-learn's C = 2 is the refit's C = 1 on its two-row softmax (head_refit)
                fitted = LogisticRegression(C=2.0, max_iter=10_000, tol=1e-10).fit(X, y)
                predicted = fitted.predict(_head_inputs(model, examples).numpy())
            correct = predicted == np.array([e[1] for e in examples])
            run, unfitted = ([c == "1" for c in outcomes[(int(client), key)]] for key in (refit_of, unfitted_of))
            run = np.array(run)
            agree, total = agree + int((correct == run).sum()), total + len(run)
            differ += int((np.array(unfitted) != run).sum())
    assert total and agree / total >= 0.95, f"{agree} of {total} refitted predictions agree with scikit-learn's"
    assert differ >= 0.1 * total, "the refit changed too few predictions for this test to tell it from the run's heads"
    assert 0.0 <= rows[last]["refit.val_acc"] <= 1.0 and 0.0 <= rows[last]["local.refit.val_acc"] <= 1.0

