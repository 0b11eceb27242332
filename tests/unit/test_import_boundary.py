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
        "from fs_fedpa.plugin.config_fs import PLUGIN_METHODS\n"
        "assert PLUGIN_METHODS == names() and 'fedpa' in names() and 'base' not in names()"
    )
    assert _loaded_after(code) == {m: False for m in HEAVY}


def _package_imports() -> dict[str, set[str]]:
    """Module -> the modules of the package and of the research's packages it imports anywhere in its source (at the
    top or inside a function), read with ``ast``; ``from fs_fedpa.x import y`` counts as importing ``fs_fedpa.x.y``
    where that is a module, else ``x``."""
    import ast

    research = [ROOT / "research" / "__init__.py"]  # and its packages; its scripts, benchmarks and tests sit on top
    research += [p for package in ("study", "harness", "tools") for p in (ROOT / "research" / package).glob("*.py")]
    modules = {}
    for path in [*(ROOT / "fs_fedpa").rglob("*.py"), *research]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets.update([base, *(f"{base}.{a.name}" for a in node.names)])
        found = set()
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
        edges[name] = found
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]] and _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_one_that_imports_it_back():
    edges = _package_imports()
    assert "fs_fedpa.privacy" in edges["research.study.sst2_protocol"]  # the reader sees lazy imports too (dp_sgd)
    assert _cycles(edges) == []


def test_imports_run_down_the_layers_tools_sit_on_top():
    """The research (study, harness, ops tools) sits on top, outside the package, and nothing of the package imports
    it; in the research, only the study imports the study; below it only the command-line tools import
    ``fs_fedpa.tools``; only the plugin, the tools (e.g. the export command) and the research import FederatedScope's
    glue."""
    edges = _package_imports()
    assert {m for m in edges if m.startswith("research.")} >= {"research.study.stats", "research.harness.compare"}
    research = {m: sorted(t for t in ts if t.startswith("research")) for m, ts in edges.items()}
    assert {m: ts for m, ts in research.items() if ts and not m.startswith("research")} == {}
    study = {m: sorted(t for t in ts if t.startswith("research.study")) for m, ts in edges.items()}
    assert {m: ts for m, ts in study.items() if ts and not m.startswith("research.study")} == {}
    upward = {m: sorted(t for t in ts if t.startswith("fs_fedpa.tools")) for m, ts in edges.items()}
    top = ("fs_fedpa.tools", "research", "fs_fedpa.__main__")  # __main__: the fs-fedpa command, over the tools
    assert {m: ts for m, ts in upward.items() if ts and not m.startswith(top)} == {}
    plugin = {m: sorted(t for t in ts if t.startswith("fs_fedpa.plugin")) for m, ts in edges.items()}
    allowed = ("fs_fedpa.plugin", "fs_fedpa._boot", "fs_fedpa.tools", "research")
    assert {m: ts for m, ts in plugin.items() if ts and not m.startswith(allowed)} == {}
