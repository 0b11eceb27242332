"""Issue 73: outside ``fs_fedpa/privacy/`` no module asks which DP mode runs; it asks the mode's policy.

Read with ``tokenize``: the attribute ``dp.mode`` or the name ``dp_mode`` (its old flat name) in code, the key
``mode`` of a ``dp=`` dict, or a string naming the key compared with ``==``/``!=`` or tested with ``in``.
Comments, docstrings and the strings that spell an override (``("fedpa.dp.mode", "sample", ...)``) are not tests
of it.
"""

from __future__ import annotations

import io
import re
import tokenize

from tests.conftest import ROOT

PACKAGE = ROOT / "fs_fedpa"
COMPARED = re.compile(r"""["'](fedpa\.)?dp[._]mode["']\s*(\)\s*(==|!=)|(not\s+)?in\b)""")
GIVEN = re.compile(r"""\bdp\s*=\s*\{[^}]*["']mode["']""")


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


def test_no_module_outside_the_privacy_package_asks_which_dp_mode_runs():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(PACKAGE / "privacy"):
            continue
        if lines := _tests_of_the_mode(path.read_text(encoding="utf-8")):
            found[path.relative_to(ROOT).as_posix()] = lines
    assert found == {}, f"modules that test fedpa.dp.mode instead of asking its policy: {found}"
