"""The research's tests share the main suite's setup (tests/conftest.py: the tested fs_fedpa is this checkout, the
tests write nothing into it, --run-slow) and its FS fixtures (the tiny GLUE data and models, built once)."""

from __future__ import annotations

import pytest

from tests.conftest import (  # noqa: F401  (pytest finds hooks by name)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_sessionfinish,
    pytest_sessionstart,
)
from tests.integration.conftest import FS_MISSING, FS_SKIP_REASON, tiny_glue, tiny_llm  # noqa: F401


@pytest.fixture(autouse=True)
def _fs_or_skip(request):
    """A test marked ``integration`` skips, saying why, where FederatedScope does not import (as in tests/)."""
    if FS_MISSING and request.node.get_closest_marker("integration"):
        pytest.skip(FS_SKIP_REASON)
