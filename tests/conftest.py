"""Shared test setup: the opt-in slow switch, and a guard that the tested fs_fedpa is this checkout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_configure(config: pytest.Config) -> None:
    """fs_fedpa.pth imports the *installed* fs_fedpa at interpreter start, and FS subprocesses use it too: refuse
    to test any fs_fedpa but this checkout's own files (an editable install of it), rather than silently testing
    other code: another checkout's editable install, or a copy that happens to hold the same files."""
    import fs_fedpa

    installed = Path(fs_fedpa.__file__).resolve().parent
    if installed != ROOT / "fs_fedpa":
        raise pytest.UsageError(
            f"fs_fedpa imports from {installed}, not from this checkout ({ROOT}), and the tests' subprocesses would "
            "run that code: run ./run.sh test (it installs this checkout editable) or pip install -e ."
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow (real data, long runs)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow test: opt in with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
