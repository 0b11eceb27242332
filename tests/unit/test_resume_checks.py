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
    with pytest.raises(ValueError, match=r"field 'global\['layer'\]' B is a view of shape \(1000000, 1000000\)"):
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
