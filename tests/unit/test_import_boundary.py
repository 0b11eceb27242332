"""The package's import boundaries, checked in fresh interpreters (the start-up hook imports fs_fedpa everywhere)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

HEAVY = ("torch", "transformers", "peft", "federatedscope")


def _loaded_after(code: str) -> dict[str, bool]:
    probe = f"import sys, json\n{code}\nprint(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bare_import_loads_nothing_heavy():
    assert _loaded_after("import fs_fedpa") == {m: False for m in HEAVY}


def test_core_loads_torch_only():
    loaded = _loaded_after(
        "import fs_fedpa.core.reconstruct, fs_fedpa.core.penalty, fs_fedpa.core.ranks, "
        "fs_fedpa.core.diagnostics, fs_fedpa.core.adaptive"
    )
    assert loaded == {"torch": True, "transformers": False, "peft": False, "federatedscope": False}


def test_public_names_resolve_lazily():
    code = "import fs_fedpa\nassert callable(fs_fedpa.reconstruct) and callable(fs_fedpa.product_penalty)"
    assert _loaded_after(code)["torch"] is True
    out = subprocess.run(
        [sys.executable, "-c", "import fs_fedpa; fs_fedpa.nope"], cwd=ROOT, capture_output=True, text=True
    )
    assert "module 'fs_fedpa' has no attribute 'nope'" in out.stderr


def test_the_method_list_comes_from_the_package_files_without_torch():
    code = (
        "from fs_fedpa.methods import names\n"
        "from fs_fedpa.plugin.config import PLUGIN_METHODS\n"
        "assert PLUGIN_METHODS == names() and 'fedpa' in names() and 'base' not in names()"
    )
    assert _loaded_after(code) == {m: False for m in HEAVY}
