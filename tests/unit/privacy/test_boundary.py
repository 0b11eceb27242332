"""Issue 73: outside ``fs_fedpa/privacy/`` no module asks which DP mode runs; it asks the mode's policy. Issue 89: nor
what kind of policy it is (one of its capability flags, :data:`FLAGS`): it calls the policy's methods.

Read with ``tokenize``: the attribute ``dp.mode`` or the name ``dp_mode`` (its old flat name) in code, the key
``mode`` of a ``dp=`` dict, or a string naming the key compared with ``==``/``!=`` or tested with ``in``.
Comments, docstrings and the strings that spell an override (``("fedpa.dp.mode", "sample", ...)``) are not tests
of it.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize

from tests.conftest import ROOT

PACKAGE = ROOT / "fs_fedpa"
COMPARED = re.compile(r"""["'](fedpa\.)?dp[._]mode["']\s*(\)\s*(==|!=)|(not\s+)?in\b)""")
GIVEN = re.compile(r"""\bdp\s*=\s*\{[^}]*["']mode["']""")
# what the workers asked of a policy before issue 89, instead of letting it act
FLAGS = ("draws_receivers", "draws_any_number", "releases", "release_weight", "private_faults", "locals_public",
         "gradient_diagnostics")  # fmt: skip


def _tests_of_the_mode(source: str) -> list[int]:
    """Line numbers in ``source`` that read or compare ``dp_mode`` (the module docstring)."""
    found = set()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    tokens = [t for t in tokens if t.type in (tokenize.NAME, tokenize.OP)]
    for before, dot, tok in zip([None, None, *tokens], [None, *tokens], tokens):
        if tok.type == tokenize.NAME and tok.string == "dp_mode":
            found.add(tok.start[0])
        elif tok.string == "mode" and dot is not None and dot.string == "." and before.string == "dp":
            found.add(tok.start[0])
    for number, line in enumerate(source.splitlines(), 1):
        if COMPARED.search(line.split("#")[0]) or GIVEN.search(line.split("#")[0]):
            found.add(number)
    return sorted(found)


def test_the_finder_finds_each_way_of_asking_the_mode():
    asked = ['if fedpa.dp.mode == "client":', "mode = cfg.fedpa.dp.mode", 'x = o.get("fedpa.dp.mode") == "sample"',
             "y = 'fedpa.dp.mode' in opts", "FedPAConfig(dp={'mode': 'sample'})", "m = fedpa.dp_mode"]  # fmt: skip
    for line in asked:
        assert _tests_of_the_mode(line + "\n") == [1], line
    not_asked = ['opts = ("fedpa.dp.mode", "sample")', '"""Under ``fedpa.dp.mode client`` ..."""',
                 "# fedpa.dp.mode sample: ..."]  # fmt: skip
    for line in not_asked:
        assert _tests_of_the_mode(line + "\n") == [], line


def _outside_privacy(finder) -> dict[str, list]:
    """``path -> what finder finds in it`` for every module of the package outside ``fs_fedpa/privacy/`` where it
    finds anything."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if not path.is_relative_to(PACKAGE / "privacy") and (hits := finder(path.read_text(encoding="utf-8"))):
            found[path.relative_to(ROOT).as_posix()] = hits
    return found


def test_no_module_outside_the_privacy_package_asks_which_dp_mode_runs():
    found = _outside_privacy(_tests_of_the_mode)
    assert found == {}, f"modules that test fedpa.dp.mode instead of asking its policy: {found}"


def _flag_reads(source: str) -> list[tuple[int, str]]:
    """``(line, flag)`` for every attribute of a :data:`FLAGS` name read in ``source`` (``policy.releases``), and
    every ``getattr``/``hasattr`` given one as a string (read with ``ast``: comments and docstrings are not reads)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in FLAGS:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in FLAGS:
                found.append((node.lineno, name.value))
    return sorted(found)


def test_the_flag_finder_finds_each_way_of_reading_a_flag():
    read = ["y = 1 if self.privacy.releases else 0",
            "x = policy.locals_public", "getattr(p, 'draws_receivers', False)",
            "hasattr(type(p), 'gradient_diagnostics')", "w = p.release_weight * 2"]  # fmt: skip
    for line in read:
        assert [n for n, _ in _flag_reads(line + "\n")] == [1], line
    not_read = ["# policy.releases", '"""policy.private_faults"""', "p.release(x)", "p.releases_more", "releases = 3"]
    for line in not_read:
        assert _flag_reads(line + "\n") == [], line


def test_no_module_outside_the_privacy_package_reads_a_flag_of_the_policy():
    found = _outside_privacy(_flag_reads)
    assert found == {}, f"modules that ask the DP policy what kind it is instead of calling it: {found}"
