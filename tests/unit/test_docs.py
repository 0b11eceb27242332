"""The docs cannot drift: every link, repository path, command, flag, `fedpa.*` key and `fs_fedpa.*` name that
README.md, yaml_configs/README.md and docs/*.md show exists in this checkout. The FS config keys of the
``federatedscope.main`` commands are checked against FS itself in tests/integration/test_docs_fs.py."""

from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from fs_fedpa.plugin.config_fs import describe_all, flat_keys
from tests import doc_commands as dc
from tests.doc_commands import FS_MAIN, ROOT

FEDPA_KEYS = {key for key, _, _ in describe_all()}  # dotted: net.round_timeout_s
FEDPA_PARTS = {key.split(".")[0] for key in FEDPA_KEYS if "." in key}  # fedpa.net names a part
# `fedpa.<word>` that docs name and that are not config keys: checkpoint entries, the log tag
NOT_CONFIG = {"fedpa.global", "fedpa.clients", "fedpa.pth"}
UNKNOWN_KEY_EXAMPLE = "fedpa.rank"  # docs/errors.md shows the refusal of a key that does not exist


def _help_targets() -> dict[str, tuple[str, str]]:
    """Every tool a doc runs with flags: name -> ('module' | 'path', target)."""
    out = {}
    for c in dc.all_commands():
        argv = c.argv
        tool = len(argv) > 2 and argv[1] == "-m" and argv[2].startswith(("fs_fedpa", "research"))
        if argv[0].startswith("python") and tool:
            if dc.is_placeholder(argv[2].split(".")[-1]):
                continue
            out[argv[2]] = ("module", argv[2])
        elif argv[0].startswith("python") and len(argv) > 1 and argv[1].endswith(".py") and argv[1] not in FS_MAIN:
            out[argv[1]] = ("path", str(ROOT / argv[1]))
    return out


# One interpreter runs every tool's --help (in-process runpy): a subprocess each would cost seconds apiece.
HELP_SCRIPT = r"""
import contextlib, io, json, runpy, sys
out = {}
for name, (kind, target) in json.loads(sys.argv[1]).items():
    buffer = io.StringIO()
    sys.argv = [target, "--help"]
    if kind == "path":  # as `python path.py` would: the script's folder first on sys.path
        sys.path.insert(0, target.rsplit("/", 1)[0])
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            if kind == "module":
                runpy.run_module(target, run_name="__main__")
            else:
                runpy.run_path(target, run_name="__main__")
    except SystemExit:
        pass
    except Exception as exc:
        buffer.write(f"FAILED: {exc!r}")
    out[name] = buffer.getvalue()
print(json.dumps(out))
"""


@cache
def _helps() -> dict[str, str]:
    targets = _help_targets()
    proc = subprocess.run(
        [sys.executable, "-c", HELP_SCRIPT, json.dumps(targets)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@cache
def _run_sh_help() -> str:
    proc = subprocess.run(["bash", str(ROOT / "run.sh"), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _long_options(text: str) -> set[str]:
    return set(re.findall(r"--[\w-]+", text))


def test_the_checker_finds_the_commands_it_checks():
    # the parser itself: a regression here would make every check below vacuous
    found = {c.argv[:3] for c in dc.all_commands()}
    assert ("./run.sh", "test") in {a[:2] for a in found}
    assert ("python", "-m", "federatedscope.main") in found
    assert ("python", "-m", "fs_fedpa.tools.export") in found
    assert len(dc.all_commands()) > 40


@pytest.mark.parametrize("doc", dc.DOC_FILES, ids=dc.rel)
def test_every_link_and_anchor_exists(doc):
    text, missing = doc.read_text(encoding="utf-8"), []
    for target in dc.links(text):
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            missing.append(target)
        elif anchor and file.suffix == ".md" and anchor not in dc.anchors(file.read_text(encoding="utf-8")):
            missing.append(f"{target} (no such heading)")
    assert missing == [], f"{dc.rel(doc)} links to what is not there: {missing}"


@pytest.mark.parametrize("doc", dc.DOC_FILES, ids=dc.rel)
def test_every_repository_path_in_code_exists(doc):
    missing = []
    for span in dc.spans(doc.read_text(encoding="utf-8")):
        for word in span.split():
            if dc.REPO_PATH.match(word):
                for path in dc.expand(word.rstrip(",.;:")):
                    if not glob.glob(str(ROOT / path)):
                        missing.append(path)
    assert missing == [], f"{dc.rel(doc)} names paths this checkout does not have: {missing}"


def test_every_command_names_a_program_that_exists_with_the_flags_it_passes():
    problems = _command_problems(dc.all_commands())
    assert problems == [], "\n".join(problems)


def test_the_command_check_catches_a_flag_a_missing_tool_and_a_subcommand_that_do_not_exist():
    bad = [
        dc.Command("x.md", "", ("python", "-m", "fs_fedpa.tools.export", "RUN", "--no-such-flag")),
        dc.Command("x.md", "", ("python", "-m", "fs_fedpa.tools.no_such_tool")),
        dc.Command("x.md", "", ("python", "-m", "fs_fedpa.config")),  # a module, not a tool
        dc.Command("x.md", "", ("./run.sh", "deploy")),
        dc.Command("x.md", "", ("./run.sh", "compare", "--no-such-flag")),
        dc.Command("x.md", "", ("scripts/no_such.sh",)),
    ]
    assert len(_command_problems(bad)) == len(bad)


def _command_problems(commands: list[dc.Command]) -> list[str]:
    helps, problems = _helps(), []
    for c in commands:
        argv = c.argv
        if argv[0].startswith("python"):
            if len(argv) < 2 or argv[1] == "-c":
                continue
            if argv[1] == "-m":
                module = argv[2]
                if not module.startswith(("fs_fedpa", "research")) or dc.is_placeholder(module.split(".")[-1]):
                    continue
                spec = importlib.util.find_spec(module)
                if spec is None or spec.origin is None:
                    problems.append(f"{c}: no module {module}")
                    continue
                if '__name__ == "__main__"' not in Path(spec.origin).read_text(encoding="utf-8"):
                    problems.append(f"{c}: {module} is not a command-line tool (no __main__)")
                    continue
                help_text = helps.get(module, "")
            elif argv[1] in FS_MAIN:
                continue
            else:
                if not (ROOT / argv[1]).is_file():
                    problems.append(f"{c}: no file {argv[1]}")
                    continue
                help_text = helps.get(argv[1], "")
            if "FAILED" in help_text or "usage" not in help_text.lower():
                problems.append(f"{c}: --help does not print a usage: {help_text[-300:]}")
                continue
            options = _long_options(help_text)
            problems += [f"{c}: {flag} is not in its --help" for flag in dc.flags(argv) if flag not in options]
        elif argv[0] == "./run.sh":
            help_text = _run_sh_help()
            sub = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else "main"
            if not re.search(rf"\./run\.sh (?:\[)?{sub}\b", help_text):
                problems.append(f"{c}: ./run.sh --help lists no subcommand {sub}")
            if sub == "test":  # pytest's own arguments
                continue
            options = _long_options(help_text)
            problems += [f"{c}: {flag} is not in ./run.sh --help" for flag in dc.flags(argv) if flag not in options]
        elif not argv[0].endswith("/"):  # scripts/..., research/benchmarks/...; a bare folder is named, not run
            if not (ROOT / argv[0]).is_file():
                problems.append(f"{c}: no file {argv[0]}")
            problems += [f"{c}: no file {w}" for w in argv[1:] if w.endswith(".yaml") and not (ROOT / w).is_file()]
    return problems


def test_every_config_file_a_command_runs_exists_and_every_fedpa_key_it_sets_is_a_key():
    problems = []
    for c in dc.all_commands():
        for i, word in enumerate(c.argv):
            if word == "--cfg" and i + 1 < len(c.argv):
                path = c.argv[i + 1]
                if path.startswith("yaml_configs/") and not (ROOT / path).is_file():
                    problems.append(f"{c}: no file {path}")
        problems += [
            f"{c}: fedpa has no key {k}"
            for k in dc.config_keys(c.argv)
            if k.startswith("fedpa.") and k[6:] not in FEDPA_KEYS and k[6:] not in flat_keys()
        ]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("doc", dc.DOC_FILES, ids=dc.rel)
def test_every_fedpa_key_and_fs_fedpa_name_the_prose_shows_exists(doc):
    """The user's guide names each key by its place; the study's records may name it as their runs did, by its old
    flat name (which still works, with a warning)."""
    problems = []
    historical = dc.rel(doc).startswith(("docs/study/", "docs/reference/"))
    keys = FEDPA_KEYS | FEDPA_PARTS | (set(flat_keys()) if historical else set())
    for span in dc.spans(doc.read_text(encoding="utf-8")):
        for word in re.findall(r"\b(?:fs_)?fedpa(?:\.\w+)+", span):
            if word in NOT_CONFIG | {UNKNOWN_KEY_EXAMPLE} or word.startswith("fs_fedpa.tools.NAME"):
                continue
            if word.startswith("fedpa."):
                if word[6:] not in keys and f"fedpa.{word.split('.')[1]}" not in NOT_CONFIG:
                    problems.append(f"no key {word}")
            elif not _resolves(word):
                problems.append(f"no name {word}")
    assert problems == [], f"{dc.rel(doc)}: {problems}"


def _resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` is a module, or an attribute path under the longest module prefix."""
    parts = dotted.split(".")
    if parts[-1] in ("py", "pth", "json", "jsonl", "md"):
        return (ROOT / "/".join(parts[:-1])).with_suffix("." + parts[-1]).exists()
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if (exc.name or "").startswith("federatedscope"):
                return True  # FS glue, checked where FS imports
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_readmes_method_list_is_the_registry():
    from fs_fedpa.methods import names

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    listed = text[text.index("<!-- methods") : text.index("<!-- /methods -->")]
    assert re.findall(r"`(\w+)`", listed) == list(names())


def _pip_line(text: str) -> list[str]:
    """The packages of the `pip install "protobuf==3.20.3" ...` line (continuations joined)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    line = next(line for line in joined.splitlines() if line.strip().startswith('pip install "protobuf=='))
    return dc._words(line)[2:]


def test_the_fs_install_lines_of_readme_install_md_and_run_sh_are_one_list():
    run_sh = (ROOT / "run.sh").read_text(encoding="utf-8")
    array = re.search(r"^FS_RUNTIME=\((.*?)\)", run_sh, re.S | re.M).group(1)
    want = dc._words(array.replace("\n", " "))
    assert "protobuf==3.20.3" in want and len(want) > 5
    for doc in ("README.md", "docs/install.md"):
        assert list(_pip_line((ROOT / doc).read_text(encoding="utf-8"))) == list(want), doc


def test_readmes_docs_table_lists_every_page():
    listed = set(dc.links((ROOT / "README.md").read_text(encoding="utf-8")))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").iterdir() if p.suffix in (".md", ".py")}
    assert pages - listed == set(), "README's docs table misses these pages"


def test_the_plugin_map_names_every_module_of_the_fs_glue():
    """docs/dev/plugin.md's "Where each concern lives" names every module of ``fs_fedpa/plugin/``: a newcomer following
    a concern finds its room there."""
    text = (ROOT / "docs" / "dev" / "plugin.md").read_text()
    start = text.index("### Where each concern lives")
    table = text[start : text.index("\n### ", start + 1)]
    modules = {p.name for p in (ROOT / "fs_fedpa" / "plugin").glob("*.py")} - {"__init__.py"}
    missing = sorted(m for m in modules if f"`{m}`" not in table)
    assert not missing, f"docs/dev/plugin.md's map leaves out {missing}"


def test_a_module_over_450_lines_says_why_in_its_docstring():
    """Issue 60: no module of the package, nor of the research's packages (study, harness, ops tools: the package's
    before issue 89), over 450 lines, unless its docstring says why it must be one file."""
    import ast

    long = {}
    research = [ROOT / "research" / package for package in ("study", "harness", "tools")]
    for path in sorted(p for folder in (ROOT / "fs_fedpa", *research) for p in folder.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 450:
            doc = ast.get_docstring(ast.parse(text)) or ""
            long[path.relative_to(ROOT).as_posix()] = "Why one module over 450 lines:" in doc
    assert all(long.values()), f"over 450 lines, no reason in the docstring: {[p for p, ok in long.items() if not ok]}"


def test_the_users_guide_is_short_and_speaks_to_users():
    """README at most 1,200 words and the guide in docs/ at most 20,000; neither names an internal issue or a path
    outside the repository (the study and the developers' notes live apart, each with its index)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    guide = {dc.rel(p): p.read_text(encoding="utf-8") for p in dc.USER_DOCS}
    assert len(readme.split()) <= 1200
    assert sum(len(t.split()) for t in guide.values()) <= 20000, {k: len(t.split()) for k, t in guide.items()}
    for name, text in {"README.md": readme, **guide}.items():
        assert not re.search(r"\b[Ii]ssues? \d+", text), name
        assert "../shared" not in text, name
    for folder in ("study", "dev"):
        index = (ROOT / "docs" / folder / "README.md").read_text(encoding="utf-8")
        pages = {p.name for p in (ROOT / "docs" / folder).glob("*.md")} - {"README.md"}
        assert pages <= set(dc.links(index)), f"docs/{folder}/README.md misses {pages - set(dc.links(index))}"
