"""Rank plans, PEFT-identical initialisation and truncation (Algorithm 1, lines 1-5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fs_fedpa import RankPlan, expand_groups, init_global_factors, truncate_factors


class _Tiny(nn.Module):
    def __init__(self, k: int, d: int):
        super().__init__()
        self.proj = nn.Linear(k, d)

    def forward(self, x):
        return self.proj(x)


def test_global_init_is_identical_to_peft_lora_init(monkeypatch):
    """Same RNG state in, same lora_A out: PEFT's a=sqrt(5) fan-in Kaiming-uniform, and B = 0."""
    peft = pytest.importorskip("peft")
    d, k, r = 24, 40, 6
    states = []
    original = torch.nn.init.kaiming_uniform_

    def recording(tensor, *args, **kwargs):
        if tuple(tensor.shape) == (r, k):
            states.append(torch.get_rng_state())
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", recording)
    torch.manual_seed(1234)
    model = peft.get_peft_model(_Tiny(k, d), peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"]))
    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", original)
    lora_A = model.base_model.model.proj.lora_A["default"].weight.detach()
    lora_B = model.base_model.model.proj.lora_B["default"].weight.detach()

    generator = torch.Generator()
    generator.set_state(states[-1])  # the state PEFT's reset_lora_parameters drew lora_A from
    B_g, A_g = init_global_factors(d, k, r, generator=generator)

    assert torch.equal(A_g, lora_A)
    assert torch.equal(B_g, lora_B)
    assert B_g.shape == (d, r) and A_g.shape == (r, k)


def test_global_init_is_not_trivially_equal_for_another_state():
    a = init_global_factors(8, 16, 4, generator=torch.Generator().manual_seed(0))[1]
    b = init_global_factors(8, 16, 4, generator=torch.Generator().manual_seed(1))[1]
    assert not torch.equal(a, b)
    assert float(a.abs().max()) <= (1 / 16) ** 0.5  # bound of U(-1/sqrt(k), 1/sqrt(k))


def test_clients_and_references_take_the_leading_slices():
    B_g, A_g = torch.arange(40.0).reshape(8, 5), torch.arange(30.0).reshape(5, 6)
    B, A = truncate_factors(B_g, A_g, 3)
    assert torch.equal(B, B_g[:, :3]) and torch.equal(A, A_g[:3])
    B.add_(1)  # fresh tensors: the client's factors never alias the server's
    assert torch.equal(B_g, torch.arange(40.0).reshape(8, 5))


def test_truncation_beyond_the_available_rank_pads_with_zeros():
    B_g, A_g = torch.randn(8, 2), torch.randn(2, 6)
    B, A = truncate_factors(B_g, A_g, 4)
    assert B.shape == (8, 4) and A.shape == (4, 6)
    assert torch.equal(B @ A, B_g @ A_g)
    assert torch.count_nonzero(B[:, 2:]) == 0 and torch.count_nonzero(A[2:]) == 0


def test_plan_defaults_are_the_homogeneous_setting():
    plan = RankPlan.build(num_clients=3, rank=4)
    assert plan.client_ranks == (4, 4, 4) and plan.reference_ranks == (4, 4, 4)
    assert plan.r_g == 4 and plan.R_g == 4


def test_plan_with_heterogeneous_ranks():
    plan = RankPlan.build(4, rank=8, client_ranks=[2, 4, 16, 4], reference_ranks=[1, 2, 4, 8])
    assert plan.r_g == 16 and plan.R_g == 8
    assert plan.client_ranks == (2, 4, 16, 4)
    plan = RankPlan.build(3, rank=8, client_ranks=np.array([2, 4, 8]))
    assert plan.client_ranks == (2, 4, 8) and plan.reference_ranks == (8, 8, 8) and plan.R_g == 8


def test_expand_groups_gives_the_papers_three_resource_groups():
    assert expand_groups([2, 4, 16], 20) == [2] * 7 + [4] * 7 + [16] * 6
    assert expand_groups([2, 4, 16], 6, sizes=[1, 2, 3]) == [2, 4, 4, 16, 16, 16]
    assert expand_groups([1, 2, 3], 3) == [1, 2, 3]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_clients=3, rank=4, client_ranks=[2, 4]), r"len\(client_ranks\)\(=2\) != number of clients\(=3\)"),
        (dict(num_clients=2, rank=4, client_ranks=[2, 0]), r"client_ranks\[1\]\(=0\) must be a positive int"),
        (dict(num_clients=2, rank=4, client_ranks=[2, -1]), r"client_ranks\[1\]\(=-1\) must be a positive int"),
        (
            dict(num_clients=2, rank=4, reference_ranks=[2, 2.5]),
            r"reference_ranks\[1\]\(=2.5\) must be a positive int",
        ),
        (dict(num_clients=2, rank=4, reference_ranks=[1, 2, 3]), r"len\(reference_ranks\)\(=3\) != number of clients"),
        (
            dict(num_clients=2, rank=4, reference_ranks=[2, 8], global_rank=4),
            r"reference_ranks\[1\]\(=8\) > R_g\(=4\)",
        ),
        (dict(num_clients=0, rank=4), r"num_clients\(=0\) must be a positive int"),
        (dict(num_clients=2, rank=0), r"rank\(=0\) must be a positive int"),
        (dict(num_clients=2, rank=2, client_ranks="24"), r"client_ranks must be a list of ints"),
        (dict(num_clients=2, rank=2, client_ranks=[True, 2]), r"client_ranks\[0\]\(=True\) must be a positive int"),
    ],
)
def test_plan_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RankPlan.build(**kwargs)


def test_plan_rejects_ranks_larger_than_the_layer():
    plan = RankPlan.build(2, rank=4, client_ranks=[4, 16])
    plan.check_layer(32, 32)
    with pytest.raises(ValueError, match=r"q_proj: client rank r_g\(=16\) > min\(d, k\)\(=8\) of its 8x64 weight"):
        plan.check_layer(8, 64, "q_proj")


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda: expand_groups([2, 4], 5, sizes=[2, 2]),
            r"group sizes \[2, 2\] sum to 4, not to the number of clients\(=5\)",
        ),
        (lambda: expand_groups([2, 4, 8], 2), r"3 groups for 2 clients"),
        (lambda: expand_groups([], 2), r"values is empty"),
        (lambda: expand_groups([2, 4], 4, sizes=[4]), r"len\(sizes\)\(=1\) != number of groups\(=2\)"),
        (lambda: truncate_factors(torch.zeros(3, 2), torch.zeros(2, 3), 0), r"rank\(=0\) must be a positive int"),
        (lambda: truncate_factors(torch.zeros(3, 2), torch.zeros(3, 3), 1), r"B has 2 columns but A has 3 rows"),
        (lambda: init_global_factors(0, 4, 2), r"d\(=0\) must be a positive int"),
    ],
)
def test_helper_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()
