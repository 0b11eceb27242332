"""What the server's aggregation hands FS: GlobalModel.adopt installs an aggregate whose rank R_g differs from the
model's r and returns the model state it wrote; FS's own two lines after ``aggregate()`` (merge_param_dict, then
load_state_dict) must accept it and leave the model applying the aggregate's product, read back through PEFT's
forward rather than through the code under test."""

from __future__ import annotations

import re

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


def test_fs_loads_what_adopt_returns_and_the_model_applies_the_rank_R_g_aggregate():
    from federatedscope.core.auxiliaries.utils import merge_param_dict

    from fs_fedpa.plugin.aggregator import Aggregated

    torch.manual_seed(0)
    R_g = 5
    model, g = _server_side(R_g)
    shared_name = "base_model.model.head.weight"  # a shared tensor, trained and averaged
    x = torch.randn(4, 12, dtype=torch.float32)
    with torch.no_grad(), model.disable_adapter():
        base = model(x)
    factors = {}
    for name in g.factors:
        d, k = (10, 12) if name.endswith("q") else (8, 12)
        factors[name] = (torch.randn(d, R_g), torch.randn(R_g, k))
    head = torch.randn(2, 3)
    written = g.adopt(Aggregated(factors, {shared_name: head}, None))

    merged = merge_param_dict(model.state_dict().copy(), written)  # FS's Server._perform_federated_aggregation
    model.load_state_dict(merged, strict=False)

    with torch.no_grad():
        delta = model(x) - base
    q, v = sorted(factors)  # "...q", "...v": the model's output is [q(x), v(x)]
    want = torch.cat([x @ (factors[n][0] @ factors[n][1]).T for n in (q, v)], -1)
    torch.testing.assert_close(delta, want, rtol=1e-4, atol=1e-4)  # applied factors: the product is Delta W itself
    torch.testing.assert_close(dict(model.named_parameters())[shared_name].detach(), head)
    # what FS was handed is the whole update, not a no-op: per module raw (B, A) at rank R_g whose scaled product is
    # the aggregate's, and the shared tensor, under the model's own state_dict keys
    assert set(written) <= set(model.state_dict())
    assert written[shared_name].equal(head)
    for n in (q, v):
        B, A = written[f"{n}.lora_B.default.weight"], written[f"{n}.lora_A.default.weight"]
        assert B.shape[1] == A.shape[0] == R_g
        s_g = 4 / R_g  # PEFT's alpha / r at the new rank
        torch.testing.assert_close(s_g * B @ A, factors[n][0] @ factors[n][1], rtol=1e-5, atol=1e-5)


def test_fs_save_model_writes_a_checkpoint_that_load_model_puts_back_into_another_servers_model(tmp_path):
    """FS's save_model/load_model on the aggregator: the second server's model computes what the first's did (its
    forward, not the factors the code under test wrote), and a checkpoint of other ranks, a pickle or a malformed
    file is refused."""
    from fs_fedpa.plugin.aggregator import Aggregated, FedPAAggregator

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
