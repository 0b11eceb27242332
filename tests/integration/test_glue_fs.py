"""GLUE sequence classification through stock FederatedScope: data, model, trainer, FedPA and FedAvg."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fs_fedpa.record import EVAL_SHARDS_FILE
from tests.integration.conftest import probe
from tests.integration.tiny_assets import (
    fs_glue_yaml,
    outdir_of,
    read_eval_results,
    run_fs,
)

pytestmark = pytest.mark.integration


def _final_metrics(cfg):
    rows = [r for r in read_eval_results(outdir_of(cfg)) if "Results_weighted_avg" in r]
    return rows[-1]["Results_weighted_avg"]


@pytest.mark.parametrize("method", ["fedpa", "FedAvg", "feddpa_t"])  # feddpa_t: its per-input test-time weights
def test_sst2_runs_and_reports_accuracy(tiny_glue, tmp_path, method):
    # Prepare: FS's own FedAvg needs no fedpa section; the plugin's data/model/trainer serve both
    cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"], **{"federate.method": method})
    if method != "fedpa":
        del cfg["fedpa"]
    # Execute
    proc = run_fs(cfg, tmp_path)
    # Assert
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = _final_metrics(cfg)
    assert 0.0 <= metrics["val_acc"] <= 1.0 and "val_f1" in metrics
    if method == "fedpa":
        assert 0.0 <= metrics["local.val_acc"] <= 1.0
    if method == "feddpa_t":  # the final evaluation weighs each input (its [CLS] state under the personal adapter)
        assert "FedDPA's weight of the global adapter over" in proc.stdout + proc.stderr


def test_local_head_never_leaves_the_client_and_is_kept_per_client(tiny_glue, tmp_path):
    cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"])
    run = probe(cfg, tmp_path)
    keys = [k for r in run["leave"] for k in r["upload_keys"]]
    assert keys and not any("classifier" in k for k in keys)
    assert all(k.endswith(("|A", "|B")) for k in keys)  # LoRA factors only
    # each client trains its own head, also with one shared model object
    heads = {r["client"]: r["local"] for r in run["leave"] if r["round"] == 1}
    assert set(heads) == {1, 2, 3} and all(any("classifier" in n for n in h) for h in heads.values())
    name = next(n for n in heads[1] if "classifier" in n)
    assert not torch.equal(heads[1][name], heads[2][name]) and not torch.equal(heads[2][name], heads[3][name])


def test_glue_splits_are_deterministic_and_cover_each_example_once(tiny_glue, tmp_path):
    """FS's LDA splitter on the plugin's GLUE data: same split twice, every train example exactly once."""
    from federatedscope.core.auxiliaries.data_builder import get_data
    from federatedscope.core.configs.config import global_cfg

    cfg = global_cfg.clone()
    yaml_cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"])
    from tests.integration.tiny_assets import dump_yaml

    cfg.merge_from_file(dump_yaml(yaml_cfg, tmp_path / "cfg.yaml"))

    def split():
        data, _ = get_data(cfg.clone())
        return {
            cid: sorted(tuple(x["input_ids"].tolist()) + (y,) for x, y in data[cid].train_data) for cid in (1, 2, 3)
        }, data

    first, data = split()
    second, _ = split()
    assert first == second
    all_train = sorted(tuple(x["input_ids"].tolist()) + (y,) for x, y in data[0].train_data)
    assert sorted(sum(first.values(), [])) == all_train
    labels = {y for x, y in data[0].train_data}
    assert labels == {0, 1}
    assert isinstance(data[1].val_data[0][0]["input_ids"], torch.Tensor)


def _examples(dataset) -> list[tuple]:
    return sorted(tuple(x["input_ids"].tolist()) + (y,) for x, y in dataset)


def test_held_out_validation_is_disjoint_from_training_and_dev_and_deterministic(tiny_glue, tmp_path):
    """data.glue_holdout: each client's val split is part of its FS train shard, trained on by nobody, never a dev
    example; its dev shard moves to test; the same examples are held out in every run and for every seed."""
    from federatedscope.core.auxiliaries.data_builder import get_data
    from federatedscope.core.configs.config import global_cfg

    from tests.integration.tiny_assets import dump_yaml

    def build(holdout, seed=0):
        cfg = global_cfg.clone()
        yaml_cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"], **{"seed": seed})
        cfg.merge_from_file(dump_yaml(yaml_cfg, tmp_path / f"cfg_{holdout}_{seed}.yaml"))
        cfg.data.glue_holdout = holdout
        return get_data(cfg)[0]

    plain, held, again = build(0.0), build(0.25), build(0.25, seed=7)
    dev = {id(e) for e in held[0].test_data}  # the tiny task repeats sentences: examples are told apart by identity
    for cid in (1, 2, 3):
        shard = _examples(plain[cid].train_data)
        train, val = _examples(held[cid].train_data), _examples(held[cid].val_data)
        assert sorted(train + val) == shard  # FS's split is unchanged; the held-out part comes out of it
        held_ids, train_ids = {id(e) for e in held[cid].val_data}, {id(e) for e in held[cid].train_data}
        assert len(val) == len(held_ids) == round(0.25 * len(shard))
        assert not held_ids & train_ids and not held_ids & dev
        assert _examples(held[cid].test_data) == _examples(plain[cid].val_data)  # the dev shard, not evaluated
        assert (_examples(again[cid].train_data), _examples(again[cid].val_data)) == (train, val)
    assert _examples(held[0].val_data) == sorted(sum((_examples(held[c].val_data) for c in (1, 2, 3)), []))


@pytest.mark.parametrize(
    "overrides",
    [
        {"federate.method": "local_only"},
        # the protocol's centralized line: FedIT with one client holding all the training data
        {"federate.method": "fedit", "federate.client_num": 1, "data.glue_holdout": 0.2},
    ],
    ids=["local_only", "centralized"],
)
def test_reference_lines_run_through_fs(tiny_glue, tmp_path, overrides):
    cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"], **overrides)
    proc = run_fs(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = _final_metrics(cfg)
    assert 0.0 <= metrics["val_acc"] <= 1.0
    if overrides["federate.method"] == "local_only":  # its paper protocol is its own factors
        assert metrics["val_acc"] == pytest.approx(metrics["local.val_acc"])
    else:
        assert metrics["val_total"] == pytest.approx(round(0.2 * 120))  # one client, a fifth of the train split


def test_trimming_trailing_padding_leaves_the_logits_unchanged():
    from transformers import BertConfig, BertForSequenceClassification

    from fs_fedpa.plugin.seqcls import trim_padding

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        num_labels=2,
    )
    model = BertForSequenceClassification(config).eval()
    lengths = [3, 9, 5]
    mask = torch.tensor([[1] * n + [0] * (24 - n) for n in lengths])
    ids = torch.randint(1, 50, (3, 24)) * mask
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    trimmed = trim_padding(batch)
    assert {k: tuple(v.shape) for k, v in trimmed.items()} == {k: (3, 9) for k in batch}
    with torch.no_grad():
        torch.testing.assert_close(model(**trimmed).logits, model(**batch).logits, atol=1e-6, rtol=1e-5)
    full = {k: v[:, :9] for k, v in batch.items()}  # nothing to trim: the same tensors come back
    assert trim_padding(full) is full


def _dev_shards(cfg_dict: dict, tmp_path: Path, **overrides) -> dict[str, list[int]]:
    """client -> indices into the dev file of its evaluation shard, as FS's data builder splits it (no training)."""
    from federatedscope.core.auxiliaries.data_builder import get_data
    from federatedscope.core.configs.config import global_cfg

    from tests.integration.tiny_assets import dump_yaml

    cfg = global_cfg.clone()
    cfg.merge_from_file(dump_yaml(cfg_dict, tmp_path / "cfg.yaml"))
    cfg.merge_from_list([x for kv in overrides.items() for x in (kv[0], str(kv[1]))])
    out = tmp_path / f"shards_{len(list(tmp_path.glob('shards_*')))}"
    cfg.merge_from_list(["outdir", str(out), "fedpa.records.save_outcomes", "True"])
    get_data(cfg)
    return json.loads((out / EVAL_SHARDS_FILE).read_text())["splits"]["val"]


def test_glue_split_seed_12345_is_fs_split_and_another_seed_draws_another(tiny_glue, tmp_path):
    cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"])
    fs_split = _dev_shards(cfg, tmp_path)
    assert _dev_shards(cfg, tmp_path, **{"data.glue_split_seed": 12345}) == fs_split
    other = _dev_shards(cfg, tmp_path, **{"data.glue_split_seed": 7})
    assert other != fs_split
    assert sorted(sum(other.values(), [])) == sorted(sum(fs_split.values(), []))  # a partition of the same file
    assert _dev_shards(cfg, tmp_path, **{"data.glue_split_seed": 7, "seed": 3}) == other  # not the run's seed


def test_bad_glue_split_seed_is_refused(tiny_glue, tmp_path):
    cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"], **{"data.glue_split_seed": -2})
    proc = run_fs(cfg, tmp_path)
    assert proc.returncode != 0 and "data.glue_split_seed(=-2)" in proc.stdout + proc.stderr


REAL_GLUE = Path(__file__).resolve().parents[3] / "shared" / "data" / "glue"
LONG_RUN = Path(__file__).resolve().parents[2] / "docs/reference/sst2_protocol/runs/long/fedit_s0.json"


@pytest.mark.slow
@pytest.mark.skipif(not (REAL_GLUE / "SST-2" / "train.tsv").is_file(), reason=f"no SST-2 in {REAL_GLUE}")
def test_split_seed_12345_reproduces_the_committed_protocol_split(tiny_glue, tmp_path):
    """The committed long-stage run's client shards of the dev set, from FS's data builder alone: seed 12345 gives
    them, as FS's own draw does; seed 1 (the split stage's) gives others."""
    import yaml

    committed = json.loads(LONG_RUN.read_text())["outcomes"]["shards"]
    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "yaml_configs/compare_sst2_protocol.yaml").read_text())
    cfg["data"]["root"] = str(REAL_GLUE)
    cfg["model"]["type"] = f"{Path(tiny_glue['model']).resolve()}@seqcls_llm"  # the split needs no MiniLM tokens
    assert _dev_shards(cfg, tmp_path, **{"data.glue_split_seed": 12345}) == committed
    assert _dev_shards(cfg, tmp_path, **{"data.glue_split_seed": 1}) != committed


def test_the_prefix_cache_is_refused_with_a_tokenizer_that_pads_left(tiny_glue, tmp_path):
    """The cache computes each record at positions 0..L-1; a left-padded record sits elsewhere in a batch (logits
    off by 8.5e-5 on MiniLM, 4e-9 with right padding). Before, nothing checked the padding side."""
    import shutil

    from tests.integration.tiny_assets import run_fs

    model = tmp_path / "left_padding"
    shutil.copytree(tiny_glue["model"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "left"}))
    cfg = fs_glue_yaml(tmp_path, model, tiny_glue["glue"], **{"model.seqcls.prefix_cache": True,
                                                              "model.seqcls.layers_to_transform": [1]})  # fmt: skip
    proc = run_fs(cfg, tmp_path)
    assert proc.returncode != 0
    assert "model.seqcls.prefix_cache needs a tokenizer that pads on the right" in proc.stderr, proc.stderr[-2000:]
    right = fs_glue_yaml(tmp_path / "right", tiny_glue["model"], tiny_glue["glue"], **{
        "model.seqcls.prefix_cache": True, "model.seqcls.layers_to_transform": [1], "federate.total_round_num": 1})
    assert run_fs(right, tmp_path / "right").returncode == 0
