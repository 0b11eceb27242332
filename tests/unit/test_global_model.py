"""What the server's aggregation leaves in FS's model: GlobalModel.adopt writes an aggregate whose rank R_g differs
from the model's r, once, and ``aggregate()`` hands FS nothing; after FS's own two lines (merge_param_dict, then
load_state_dict) the model applies the aggregate's product, read back through PEFT's forward rather than through the
code under test. FS's checkpoint of the global model round-trips."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip(
    "federatedscope", reason="FederatedScope is not installed: what the aggregator returns to FS is NOT checked "
    "(pip install --no-deps ../shared/vendor/FederatedScope-llm-*.tar.gz)"
)  # fmt: skip
peft = pytest.importorskip("peft")


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v, self.head = nn.Linear(12, 10), nn.Linear(12, 8), nn.Linear(3, 2)

    def forward(self, x):
        return torch.cat([self.q(x), self.v(x)], -1)


def _server_side(R_g: int, client_rank: int = 2):
    """A PEFT LoRA model (r 2 on q and v, its head shared) and the server's GlobalModel of FedPA-LoRA on it: 3
    clients of rank ``client_rank``, global rank ``R_g``."""
    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.core.ranks import RankPlan
    from fs_fedpa.methods import METHODS, get_method
    from fs_fedpa.plugin.global_model import GlobalModel

    model = peft.get_peft_model(_Two(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q", "v"]))
    model.base_model.model.head.weight.requires_grad_(True)
    get_method("fedpa")
    method = METHODS["fedpa"](FedPAConfig(), RankPlan.build(3, client_rank, global_rank=R_g))
    method.bind({"q": (10, 12), "v": (8, 12)})
    return model, GlobalModel(model, method, ["base_model.model.head.weight"], {})


def test_an_aggregation_writes_the_model_once_and_hands_fs_nothing_to_merge(tmp_path, monkeypatch):
    """Issue 89: adopt wrote the aggregate into the model and returned it, and FS's merge wrote it again. Now the
    aggregator reads the round from the GlobalModel (as open_round opened it), adopt writes the rank-R_g aggregate
    once (one set_factors) and aggregate returns {}: after FS's own two lines the model applies the weighted mean of
    the uploads' products (rank 4 <= R_g: exact) and of their heads, read back through PEFT's forward."""
    from federatedscope.core.auxiliaries.utils import merge_param_dict

    from fs_fedpa import lora
    from fs_fedpa.config_sections import RecordsConfig
    from fs_fedpa.plugin.aggregator import FedPAAggregator
    from fs_fedpa.plugin.payload import encode_factors, encode_tensors
    from fs_fedpa.plugin.record_fs import RoundLog

    # Prepare
    torch.manual_seed(0)
    model, g = _server_side(R_g=5)
    head_name = "base_model.model.head.weight"  # a shared tensor, trained and averaged
    shapes = {n: (B.shape[0], A.shape[1]) for n, (B, A) in g.factors.items()}
    log = RoundLog(str(tmp_path), RecordsConfig(diagnostics="light"))
    aggregator = FedPAAggregator(g.method, log, global_model=g, shapes=(shapes, {head_name: (2, 3)}))
    uploads = {c: {n: (torch.randn(d, 2), torch.randn(2, k)) for n, (d, k) in shapes.items()} for c in (1, 2)}
    heads = {c: torch.randn(2, 3) for c in (1, 2)}
    feedback = [(5, {"lora": encode_factors(uploads[c]), "shared": encode_tensors({head_name: heads[c]})})
                for c in (1, 2)]  # fmt: skip
    x = torch.randn(4, 12)
    with torch.no_grad(), model.disable_adapter():
        base = model(x)
    writes, set_factors = [], lora.set_factors
    monkeypatch.setattr(lora, "set_factors", lambda *a, **k: (writes.append(a[1]), set_factors(*a, **k))[1])
    # Execute
    g.open_round(3, [2, 1])
    returned = aggregator.aggregate({"client_feedback": feedback, "staleness": [(1, 0), (2, 0)]})
    merged = merge_param_dict(model.state_dict().copy(), returned)  # FS's Server._perform_federated_aggregation
    model.load_state_dict(merged, strict=False)
    # Assert
    assert returned == {} and len(writes) == 1
    (record,) = [json.loads(line) for line in Path(log.path).read_text().splitlines()]  # the diagnostics file
    assert record["round"] == 3 and record["clients"] == [1, 2]
    with torch.no_grad():
        delta = model(x) - base
    q, v = sorted(shapes)  # "...q", "...v": the model's output is [q(x), v(x)]
    mean = {n: sum(0.5 * uploads[c][n][0] @ uploads[c][n][1] for c in (1, 2)) for n in (q, v)}
    torch.testing.assert_close(delta, torch.cat([x @ mean[n].T for n in (q, v)], -1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.base_model.model.head.weight.detach(), (heads[1] + heads[2]) / 2)
    assert all(B.shape[1] == 5 for B, _ in writes[0].values())  # the rank-R_g raw factors, written at rank R_g


def test_fs_save_model_writes_a_checkpoint_that_load_model_puts_back_into_another_servers_model(tmp_path):
    """FS's save_model/load_model on the aggregator: the second server's model computes what the first's did (its
    forward, not the factors the code under test wrote), and a checkpoint of other ranks, a pickle or a malformed
    file is refused."""
    from fs_fedpa.aggregation import Aggregated
    from fs_fedpa.plugin.aggregator import FedPAAggregator

    torch.manual_seed(0)
    model, g = _server_side(R_g=5)
    factors = {n: (torch.randn(B.shape[0], 5), torch.randn(5, A.shape[1])) for n, (B, A) in g.factors.items()}
    g.adopt(Aggregated(factors, {"base_model.model.head.weight": torch.randn(2, 3)}, None))
    path = tmp_path / "final_model.pt"
    FedPAAggregator(g.method, None, global_model=g, run={"outdir": "x"}).save_model(str(path), 7)

    torch.manual_seed(0)  # the same base weights (a real server's pretrained model) ...
    other, g2 = _server_side(R_g=5)
    with torch.no_grad():  # ... and other adapter and head values: nothing but the file can make the two agree
        for p in other.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p))
    assert FedPAAggregator(g2.method, None, global_model=g2).load_model(str(path)) == 7
    x = torch.randn(4, 12)
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x))
    torch.testing.assert_close(other.base_model.model.head.weight, model.base_model.model.head.weight)
    assert torch.load(path, weights_only=True)["fedpa"]["run"] == {"outdir": "x"}

    _, g3 = _server_side(R_g=5, client_rank=3)
    with pytest.raises(ValueError, match="was saved by method"):
        g3.load_checkpoint(str(path))
    _, g4 = _server_side(R_g=4)
    with pytest.raises(ValueError, match=r"R_i \[5, 5, 5\]; its config says .* \[4, 4, 4\]"):  # R_i = R_g here
        g4.load_checkpoint(str(path))
    torch.save({"fedpa": {"global": {}}, "x": nn.Linear(1, 1)}, tmp_path / "pickle.pt")  # needs code to unpickle
    with pytest.raises(ValueError, match="not read"):
        g2.load_checkpoint(str(tmp_path / "pickle.pt"))
    saved = torch.load(path, weights_only=True)
    for broken, match in [({k: v for k, v in saved.items() if k != "model"}, "not a checkpoint"),
                          ({**saved, "fedpa": {**saved["fedpa"], "global": {"q": torch.ones(2)}}}, "not a checkpoint"),
                          ({**saved, "model": {}}, "lacks the shared tensors")]:  # fmt: skip
        torch.save(broken, tmp_path / "broken.pt")
        with pytest.raises(ValueError, match=match):
            g2.load_checkpoint(str(tmp_path / "broken.pt"))


def test_load_model_refuses_nan_inf_rank_0_and_planted_factors_naming_file_and_module(tmp_path):
    """Issue 88: FS's load_model installed NaN/Inf factors and died on rank-0 factors with ZeroDivisionError. Each
    is refused with one line naming the file and the module, and nothing is installed."""
    from fs_fedpa.plugin.aggregator import FedPAAggregator

    torch.manual_seed(0)
    _, g = _server_side(R_g=5)
    path = tmp_path / "final_model.pt"
    FedPAAggregator(g.method, None, global_model=g, run={"outdir": "x"}).save_model(str(path), 3)
    saved = torch.load(path, weights_only=True)
    name = next(iter(saved["fedpa"]["global"]))
    B, A = saved["fedpa"]["global"][name]

    def variant(pair):
        return {**saved, "fedpa": {**saved["fedpa"], "global": {**saved["fedpa"]["global"], name: pair}}}

    nan, inf = B.clone(), A.clone()
    nan[0, 0], inf[0, 0] = float("nan"), float("inf")
    planted = torch.zeros(1).expand(*B.shape)  # every element over one float: a planted view
    for pair, named in (((nan, A), "B holds a NaN or an Inf"), ((B, inf), "A holds a NaN or an Inf"),
                        ((B[:, :0], A[:0]), "has shapes B (10, 0), A (0, 12)"),
                        ((planted, A), f"B is a view of shape {tuple(B.shape)}")):  # fmt: skip
        torch.save(variant(pair), tmp_path / "bad.pt")
        _, fresh = _server_side(R_g=5)
        before = {n: (b.clone(), a.clone()) for n, (b, a) in fresh.factors.items()}
        with pytest.raises(ValueError, match=re.escape(named)) as caught:
            fresh.load_checkpoint(str(tmp_path / "bad.pt"))
        assert str(tmp_path / "bad.pt") in str(caught.value) and repr(name) in str(caught.value)
        assert all(torch.equal(b, fresh.factors[n][0]) for n, (b, _) in before.items())  # nothing installed
