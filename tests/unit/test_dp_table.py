"""The sample-level table of ``fs_fedpa.tools.dp_table``: its D is what PEFT trains in the cell, and its z is the noise
multiplier the committed DP-SGD runs used (their ledgers), so its bound b / (z sqrt(D)) is about those runs."""

from __future__ import annotations

import json
import math
import re

import pytest

from fs_fedpa.tools import dp_table
from tests.conftest import ROOT

RUNS = ROOT / "docs" / "reference" / "sst2_protocol" / "runs" / "privacy"


def _minilm_lora(**lora):
    """{name: size} of what PEFT trains on MiniLM-L6's shapes (hidden 384, 6 layers; a small vocabulary, which the
    trained entries do not depend on) with a LoRA of ``lora`` on query and value and a two-label head."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                     intermediate_size=1536, num_labels=2)  # fmt: skip
    model = peft.get_peft_model(transformers.BertForSequenceClassification(config),
                                peft.LoraConfig(task_type="SEQ_CLS", target_modules=["query", "value"], **lora))
    return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}


def test_d_is_what_peft_trains_in_the_cell():
    trained = _minilm_lora(r=4, lora_alpha=8)
    assert sum(trained.values()) == dp_table.trained("fedpa / fedit / fedsa_lora")
    assert sum(v for n, v in trained.items() if "lora_A" not in n) == dp_table.trained("ffa_lora / fedsvd")


def test_z_and_the_bound_are_those_of_the_committed_runs():
    files = sorted(RUNS.glob("tune_*_s0.json"))
    if not files:
        pytest.skip(f"no committed privacy run in {RUNS}")
    clients = json.loads(files[0].read_text())["privacy"]["dp_clients"]
    client = max(clients.values(), key=lambda c: c["n"])
    text = dp_table.sample_table(8.0, 210, [client["n"]], [client["b"]])
    row = next(line for line in text.splitlines() if line.startswith(f"| {client['n']:,} |"))
    z, both, b_only = (float(x) for x in re.findall(r"\| ([0-9.]+)", row)[2:5])
    assert z == pytest.approx(client["noise_multiplier"], rel=0.01)  # the run's own calibration, from its config
    for value, D in ((both, 37_634), (b_only, 19_202)):  # 12 modules of r (d + k), or r d, and the 384 x 2 head
        assert value == pytest.approx(client["b"] / (client["noise_multiplier"] * math.sqrt(D)), rel=0.01)


def test_the_regimes_d_is_what_peft_trains_on_the_top_layer_at_rank_2():
    """--layers 1 --rank 2 --frozen-head: LoRA r = 2 on MiniLM's top layer (layers_to_transform [5]), the head not
    noised: D is PEFT's trainable LoRA entries alone."""
    lora = {n: v for n, v in _minilm_lora(r=2, lora_alpha=4, layers_to_transform=[5]).items() if "lora_" in n}
    assert sum(lora.values()) == dp_table.trained("fedpa / fedit / fedsa_lora", rank=2, layers=1, head=False)
    assert sum(v for n, v in lora.items() if "lora_B" in n) == dp_table.trained("ffa_lora / fedsvd", rank=2, layers=1,
                                                                                 head=False)  # fmt: skip
    text = dp_table.sample_table(8.0, 200, [6424], [256], "poisson", "pld", rank=2, layers=1, head=False)
    assert "(D = 3,072)" in text and "Poisson, b expected; add_remove; pld" in text


def test_the_dp_regimes_knobs_give_the_noise_its_search_runs_used(capsys, monkeypatch):
    """``--rounds R --tau τ`` (the steps R·τ) with the dpregime stage's b, sampling and accountant: the z of the
    largest client of a committed search run (its ledger), and D of the top two layers without the head (not in D when frozen)."""
    files = sorted((RUNS.parent / "dpregime").glob("search_b256_tau2_local_*_s0.json"))
    if not files:
        pytest.skip(f"no committed dpregime search run in {RUNS.parent / 'dpregime'}")
    clients = json.loads(files[0].read_text())["privacy"]["dp_clients"]
    client = max(clients.values(), key=lambda c: c["n"])
    argv = ["dp_table", "--sample", "--rounds", "60", "--tau", "2", "--n", str(client["n"]), "--batch", "256",
            "--sampling", "poisson", "--accountant", "pld", "--layers", "2", "--frozen-head"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    dp_table.main()
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith(f"| {client['n']:,} |"))
    z = float(re.findall(r"\| ([0-9.]+)", row)[2])
    assert z == pytest.approx(client["noise_multiplier"], rel=0.01) and "over 120 steps" in text
    assert "(D = 12,288)" in text  # r (d + k) on 4 modules: query and value of two layers


def test_the_client_level_table_releases_what_peft_trains_on_the_top_two_layers_with_the_head():
    """--layers 2 --federated-head (the cross-device part): FedIT releases every trained entry PEFT has with LoRA
    r = 4 on layers [4, 5] and the head; FFA-LoRA B and the head; FedPA-LoRA the d x k product of each module."""
    trained = _minilm_lora(r=4, lora_alpha=8, layers_to_transform=[4, 5])
    minilm = "MiniLM-L6 (this cell)"
    assert dp_table.released(minilm, "fedit", layers=2, head=True) == sum(trained.values())
    b_and_head = sum(v for n, v in trained.items() if "lora_A" not in n)
    assert dp_table.released(minilm, "ffa_lora / fedsvd", layers=2, head=True) == b_and_head
    assert dp_table.released(minilm, "fedpa", layers=2, head=True) == 4 * 384 * 384 + 384 * 2 + 2
    text = dp_table.table(8.0, 30, 0.2, layers=2, head=True)
    row = next(line for line in text.splitlines() if line.startswith(f"| {minilm} | fedit |"))
    assert f"| {sum(trained.values()):,} |" in row and "top 2 of each model's layers, with the head" in text


def test_the_pld_table_over_more_steps_than_its_bound_is_refused_in_one_line(capsys):
    """Issue 88: ``--accountant pld`` over 10^7 steps ran silently with no bound; now one line, before any work."""
    import time

    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        dp_table.main(["--sample", "--accountant", "pld", "--steps", "10000000", "--n", "6797", "--batch", "64"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and time.perf_counter() - start < 5
    assert "--accountant pld composes at most 1,000,000 steps (here 10,000,000)" in err and "--accountant rdp" in err
