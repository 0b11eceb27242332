"""What of a round's statistics leaves a client, per DP mode (its client policy, fs_fedpa.privacy)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fs_fedpa import privacy as dp
from fs_fedpa.privacy.sample_level import SPENT_STATS

STATS = {"alignment_loss": 0.1, "lam": 1.0, "num_train_data": 600, "restarted": 0, "state_lost": 0,
         "delta_norm": 2.0, "change_norm": 1.0, "grad_ratio_first": 0.3, "grad_ratio_last": 0.2}  # fmt: skip


def _fedpa(mode: str):
    return SimpleNamespace(dp=SimpleNamespace(mode=mode, seed=-1, clip=1.0, min_records=0))


@pytest.mark.parametrize(
    ("mode", "kept", "size"),
    [
        ("none", set(STATS), 32),  # without DP, every statistic, and FS's sample count
        # the raw-gradient ratios stay; its account of what it spent goes with them
        ("sample", set(STATS) - {"grad_ratio_first", "grad_ratio_last"} | set(SPENT_STATS), 32),
        ("client", {"state_lost"}, 1),  # only a fault of its storage; its size is private too
    ],
)
def test_what_leaves_the_client(mode, kept, size):
    cls = dp.mechanism_of(_fedpa(mode)).Client
    privacy = cls.__new__(cls)  # the filter alone: no trainer to hook
    privacy.fedpa = _fedpa(mode)
    privacy.dp_sgd = SimpleNamespace(plan_in_use=None)
    privacy.trainer = SimpleNamespace(ctx={"num_train_data": 600})
    assert set(privacy.stats(dict(STATS))) == kept
    assert privacy.sample_size(32) == size
