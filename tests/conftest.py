"""Shared test setup: markers, the opt-in slow switch and seeded factor builders."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # test the checkout, even if an older fs_fedpa is installed
    sys.path.insert(0, str(ROOT))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow (real data, long runs)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow test: opt in with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
