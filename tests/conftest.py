"""Shared test setup: the opt-in slow switch, and a guard that the tested fs_fedpa is this checkout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_configure(config: pytest.Config) -> None:
    """fs_fedpa.pth imports the *installed* fs_fedpa at interpreter start, and FS subprocesses use it too:
    refuse to test a stale install instead of silently testing other code."""
    import fs_fedpa

    installed = Path(fs_fedpa.__file__).resolve().parent
    stale = [
        str(src.relative_to(ROOT))
        for src in (ROOT / "fs_fedpa").rglob("*.py")
        if not (installed / src.relative_to(ROOT / "fs_fedpa")).is_file()
        or (installed / src.relative_to(ROOT / "fs_fedpa")).read_bytes() != src.read_bytes()
    ]
    if stale:
        raise pytest.UsageError(
            f"the installed fs_fedpa ({installed}) differs from this checkout in {stale[:5]}: "
            "run ./run.sh test (it installs the checkout first) or pip install -e ."
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
