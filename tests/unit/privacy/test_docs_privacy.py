"""docs/privacy.md's list of what a resume may not change is the code's (issue 73: "updated to the code, line for
line"): each key that :func:`fs_fedpa.privacy.accounting_settings` compares for a mode is named in the list, and the
list names nothing the code does not compare."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from fs_fedpa import privacy
from fs_fedpa.config import FedPAConfig
from tests.conftest import ROOT

BULLET = re.compile(r"^- A resume with other accounting settings is refused.*?(?=^- |\Z)", re.S | re.M)


def _listed() -> tuple[set[str], set[str], set[str]]:
    """(keys named for both modes, for client mode, for sample mode) in the docs' bullet."""
    text = BULLET.search((ROOT / "docs" / "privacy.md").read_text(encoding="utf-8")).group(0)
    both, rest = text.split("`sample_client_num`", 1)
    client_part, sample_part = rest.split(" or\n", 1) if " or\n" in rest else rest.split(" or ", 1)
    names = lambda part: set(re.findall(r"`([a-z_.]+)`", part))  # noqa: E731
    return names(both), names(client_part) | {"sample_client_num"}, names(sample_part)


def _compared(mode: str) -> set[str]:
    """Each key the code compares on a resume in ``mode`` (with a target epsilon), without its section
    (``dp.clip``, ``client_num``)."""
    fedpa = FedPAConfig(dp={"mode": mode, "clip": 1.0, "epsilon": 8.0})
    cfg = SimpleNamespace(
        fedpa=fedpa,
        federate=SimpleNamespace(client_num=10, sample_client_num=5, total_round_num=3),
        dataloader=SimpleNamespace(batch_size=4, drop_last=False),
        train=SimpleNamespace(local_update_steps=2, batch_or_epoch="batch"),
    )
    return {key.split(" ")[0].split(".", 1)[1] for key in privacy.accounting_settings(cfg)}


@pytest.mark.parametrize("mode", ["client", "sample"])
def test_the_docs_list_of_resume_refusals_is_what_the_code_compares(mode):
    both, client, sample = _listed()
    assert both | (client if mode == "client" else sample) == _compared(mode)


def test_the_list_reader_reads_the_three_parts():
    both, client, sample = _listed()
    assert {"dp.mode", "client_num"} <= both and client == {"sample_client_num"} and "dp.local_tensors" in sample
