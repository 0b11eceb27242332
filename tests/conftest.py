"""Shared test setup: the opt-in slow switch, a guard that the tested fs_fedpa is this checkout, and one that the
tests write nothing into it."""

from __future__ import annotations

import subprocess
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


CACHES = {"__pycache__", ".hypothesis", ".pytest_cache"}
_BEFORE = pytest.StashKey[set]()  # the untracked files at the start of the session


def _written() -> set[str] | None:
    """The checkout's untracked files, ignored ones included, less Python's and the test tools' caches; None outside
    a git work tree."""
    try:
        out = subprocess.run(["git", "ls-files", "--others", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    paths = (p for p in out.decode(errors="replace").split("\0") if p)
    return {p for p in paths if not CACHES & set(Path(p).parts) and ".egg-info" not in p and not p.endswith(".pyc")}


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller (or the only process) checks, after every worker
        session.config.stash[_BEFORE] = _written()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test that writes into the checkout (FS's default outdir 'exp', a relative save_to) fails the session by
    name of the file, instead of racing a test that checks the checkout from another worker."""
    before = session.config.stash.get(_BEFORE, None)
    if before is None or not (new := sorted((_written() or set()) - before)):
        return
    shown = "\n  ".join(new[:20]) + (f"\n  ... and {len(new) - 20} more" if len(new) > 20 else "")
    sys.stderr.write(f"\n[tests] the tests wrote into the checkout {ROOT} (write under tmp_path instead):\n  {shown}\n")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_addoption(parser: pytest.Parser) -> None:
    try:
        parser.addoption("--run-slow", action="store_true", help="run tests marked slow (real data, long runs)")
    except ValueError:  # research/tests/conftest.py, which shares this file's hooks, added it first
        pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow test: opt in with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA and the certificates of a server and two clients (``fs_fedpa.tools.make_certs``; the openssl CLI)."""
    from tests.unit.test_tls import make_certs

    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> Path:
    """As :func:`certs`, under another CA."""
    from tests.unit.test_tls import make_certs

    return make_certs(tmp_path_factory.mktemp("other"))
