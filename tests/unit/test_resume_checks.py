"""A resume point's tensors are checked for what they claim to be before any of their values is read."""

from __future__ import annotations

import io
import time

import pytest
import torch

from fs_fedpa import resume


def _planted(size: int) -> torch.Tensor:
    """A (size, size) view over one float, as ``torch.load(weights_only=True)`` gives it back from a planted file."""
    buffer = io.BytesIO()
    torch.save(torch.zeros(1).expand(size, size), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_planted_stride_0_view_is_refused_before_its_values_are_read():
    huge = _planted(10**6)  # 10^12 elements over 4 bytes: isfinite over it would need 1 TB
    assert huge.stride() == (0, 0)
    start = time.perf_counter()
    planted = r"field 'global_model\.factors\['layer'\]' B is a view of shape \(1000000, 1000000\)"
    with pytest.raises(ValueError, match=planted):
        resume.check_global({"layer": (huge, torch.zeros(2, 8))}, "point.pt", {"layer": (torch.zeros(8, 2),
                            torch.zeros(2, 8))}, max_rank=2)  # fmt: skip
    assert time.perf_counter() - start < 5  # refused from its strides, not after reading it
    # the same view at the expected shape is refused too: its storage holds one value for 16
    with pytest.raises(ValueError, match="over a smaller storage"):
        resume.check_global({"layer": (_planted(8)[:, :2], torch.zeros(2, 8))}, "point.pt",
                            {"layer": (torch.zeros(8, 2), torch.zeros(2, 8))}, max_rank=2)  # fmt: skip


def test_well_formed_factors_pass_and_a_nan_is_still_named():
    initial = {"layer": (torch.zeros(8, 2), torch.zeros(2, 8))}
    resume.check_global({"layer": (torch.randn(8, 2), torch.randn(2, 8).T.contiguous().T)}, "p", initial, 2)
    bad = torch.randn(2, 8)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="holds a NaN or an Inf"):
        resume.check_global({"layer": (torch.randn(8, 2), bad)}, "p", initial, 2)


def test_a_resume_point_of_another_version_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"version 1; this fs_fedpa reads version 3"):
        resume.check_server_fields({"method": "fedpa", "round": 2}, "old.pt")  # before version 2: no field


def _whole_point() -> dict:
    import torch

    parts = {part: dict.fromkeys(keys, {}) for part, keys in resume.PARTS.items()}
    parts["round_log"]["records"] = []
    parts["aggregator"] = {"generator": torch.Generator().get_state(), "failed_in_a_row": 0}
    return {"version": resume.VERSION, "method": "fedpa", "round": 2, "plan": [[4], [4], 4], "settings": {},
            "rng": {}, **parts}  # fmt: skip


def test_a_whole_point_passes_and_each_missing_part_or_key_is_refused_naming_it():
    resume.check_server_fields(_whole_point(), "p.pt")  # the refusals below are each for the one thing removed
    for part, keys in resume.PARTS.items():
        saved = _whole_point()
        del saved[part]
        with pytest.raises(ValueError, match=f"no field '{part}'"):
            resume.check_server_fields(saved, "p.pt")
        for key in keys:
            saved = _whole_point()
            del saved[part][key]
            with pytest.raises(ValueError, match=rf"p\.pt.* no field '{part}\.{key}'"):
                resume.check_server_fields(saved, "p.pt")
    saved = _whole_point()
    saved["aggregator"]["failed_in_a_row"] = -1
    with pytest.raises(ValueError, match="'failed_in_a_row' is -1"):
        resume.check_server_fields(saved, "p.pt")


def test_hetlora_restores_its_pruned_ranks_and_refuses_others():
    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.core.ranks import RankPlan
    from fs_fedpa.methods import get_method

    plan = RankPlan.build(3, 4, client_ranks=[1, 2, 4])
    method = get_method("hetlora")(FedPAConfig(client_ranks=[1, 2, 4]), plan)
    method.current = [1, 2, 3]
    fresh = get_method("hetlora")(FedPAConfig(client_ranks=[1, 2, 4]), plan)
    fresh.load_state_dict(method.state_dict(), "p.pt")
    assert fresh.current == [1, 2, 3]
    for bad in ({"current": [1, 3, 3]}, {"current": [1, 2]}, {}, {"current": "x"}):
        with pytest.raises(ValueError, match=r"p\.pt.*'current'"):
            fresh.load_state_dict(bad, "p.pt")
    with pytest.raises(ValueError, match="method state"):
        get_method("fedpa")(FedPAConfig(), plan).load_state_dict({"current": [1]}, "p.pt")
