"""Many clients, few sampled, a state budget: the clients' states spill to disk and come back bit for bit, so a run
ends exactly as with no budget; a damaged spill file is that client's loss alone."""

from __future__ import annotations

import re

import pytest
import torch

from tests.integration.conftest import probe
from tests.integration.tiny_assets import fs_glue_yaml, write_tiny_glue

pytestmark = pytest.mark.integration

# the methods whose clients keep something of their own across rounds beyond the shared reference: own factors
# (FedPA-LoRA, FedSA-LoRA's B, local training), a personal adapter (FedDPA), merges into the base weights (FedEx-LoRA,
# FLoRA), the modules folded for the round (Fed-PLoRA); every one keeps its local head
STATEFUL = ["fedpa", "fedsa_lora", "local_only", "feddpa_t", "fedex_lora", "flora", "fed_plora"]
STATE_MB = 0.022  # about five clients' states of the tiny BERT (4 LoRA modules, r = 4, and the head)


@pytest.fixture(scope="module")
def many(tmp_path_factory, tiny_glue):
    root = tmp_path_factory.mktemp("many_glue")
    glue, _ = write_tiny_glue(root / "glue", n_train=500, n_dev=100)
    return {"glue": glue, "model": tiny_glue["model"]}


def _cfg(many, tmp_path, method, **more):
    return fs_glue_yaml(tmp_path, many["model"], many["glue"], **{
        "federate.method": method, "federate.client_num": 50, "federate.sample_client_num": 5,
        "federate.total_round_num": 2, "data.splitter": "iid", "data.splitter_args": [], "fedpa.eval.local": True,
        "train.local_update_steps": 2, "expname": method, **more,
    })  # fmt: skip


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k, v in a.items():
        if isinstance(v, dict):
            _same(v, b[k], f"{what}/{k}")
        elif isinstance(v, tuple):
            assert all(torch.equal(x, y) for x, y in zip(v, b[k])), f"{what}/{k}"
        else:
            assert torch.equal(v, b[k]), f"{what}/{k}"


@pytest.mark.parametrize("method", STATEFUL)
def test_a_budget_of_five_clients_ends_as_an_unlimited_one(many, tmp_path, method):
    unlimited = probe(_cfg(many, tmp_path / "a", method), tmp_path / "a")
    tight = probe(_cfg(many, tmp_path / "b", method, **{"fedpa.store.state_budget_mb": STATE_MB}), tmp_path / "b")
    for part in ("global", "merged", "clients", "offsets", "personal", "local"):
        _same(unlimited["final"][part], tight["final"][part], part)
    assert len(unlimited["final"]["clients"]) >= 5  # several clients trained (5 of 50 a round)
    log = (tmp_path / "b" / "exp" / method / "exp_print.log").read_text()
    spills = [int(x) for x in re.findall(r"client state store: (\d+) spills", log)]
    assert spills and spills[-1] > 0, "the budget never spilled a client"


def test_a_damaged_spill_file_is_that_clients_loss_alone(many, tmp_path):
    cfg = _cfg(many, tmp_path, "fedpa", **{"fedpa.store.state_budget_mb": STATE_MB, "federate.total_round_num": 3})
    run = probe(cfg, tmp_path, env={"FS_PROBE_DAMAGE_SPILL": "1"})
    log = (tmp_path / "exp" / "fedpa" / "exp_print.log").read_text()
    assert "its spilled state" in log and "restarts from the global reference" in log
    assert [a["round"] for a in run["aggregate"]] == [0, 1, 2]  # the federation went on


@pytest.mark.parametrize("eval_freq", [1, 10])
def test_every_damage_to_a_spilled_file_is_that_clients_loss_alone(many, tmp_path, eval_freq):
    """Issue 42: a spilled file cut short, a link to /dev/zero or to another client's file, grown to 20 GB, a
    pickle, or two clients' files swapped: each is refused with its reason, that client restarts from the reference
    it receives (with diagnostics on, evaluating every round or never between rounds), and the federation goes on."""
    kinds = "truncate,zero_link,grow,pickle,swap,link_other"
    cfg = _cfg(many, tmp_path, "fedpa", **{
        "federate.client_num": 6, "federate.sample_client_num": 6, "fedpa.store.state_budget_mb": 0.009,
        "federate.total_round_num": 3, "eval.freq": eval_freq, "fedpa.records.diagnostics": "full",
    })  # fmt: skip
    run = probe(cfg, tmp_path, env={"FS_PROBE_DAMAGE_SPILL": kinds})
    log = (tmp_path / "exp" / "fedpa" / "exp_print.log").read_text()
    for reason in ("bytes, written as", "is a link (to '/dev/zero')", "is a link (to", "was written for client"):
        assert reason in log, reason
    assert "restarts from the global reference" in log
    assert [a["round"] for a in run["aggregate"]] == [0, 1, 2]  # the federation went on
    lost = [s for s in run["sent"] if s["stats"].get("state_lost")]
    assert lost, "no client reported a lost state to the server"


def test_share_equal_shares_only_equal_frozen_values():
    """What clients share of their setup (:func:`fs_fedpa.plugin.common.share_equal`): an equal frozen config is
    the previous one, an unequal or unfrozen one stays its own, and one edited after it was shared is no longer
    handed out for the unedited value."""
    from federatedscope.core.configs.config import global_cfg

    from fs_fedpa.plugin.common import share_equal

    first = global_cfg.clone()
    first.freeze(save=False)
    second = first.clone()
    assert second is not first and share_equal("test cfg", first) is first
    assert share_equal("test cfg", second) is first
    other = first.clone()
    other.defrost()
    other.seed = first.seed + 1
    other.freeze(save=False)
    assert share_equal("test cfg", other) is other  # unequal: its own, and now the one the next may share
    unfrozen = other.clone()
    unfrozen.defrost()
    assert share_equal("test cfg", unfrozen) is unfrozen
    other.defrost()  # a wrapper edits the shared one in place (FS's FedProx and NbAFL trainers do)
    other.seed = first.seed + 2
    other.freeze(save=False)
    fresh = first.clone()
    fresh.defrost()
    fresh.seed = first.seed + 1
    fresh.freeze(save=False)
    assert share_equal("test cfg", fresh) is fresh
    assert share_equal("test names", {"a", "b"}) == {"a", "b"}
    names = share_equal("test names", {"a", "b"})
    assert share_equal("test names", {"b", "a"}) is names and share_equal("test names", {"a"}) == {"a"}
