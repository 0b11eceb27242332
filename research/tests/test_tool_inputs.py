"""The research's tools end a bad input in one line naming the flag, exit 2, and no traceback, as the plugin's do
(tests/unit/test_tool_inputs.py, whose check this runs)."""

from __future__ import annotations

import pytest

from tests.unit import test_tool_inputs as plugin_tools

CASES = [
    ("research.tools.gpu_check", ["--tiny", "--out", "{file}/gpu.json"], "--out"),
    ("research.tools.gpu_check", ["--tiny", "--step-timeout", "-5"], "--step-timeout"),
    ("research.study.sst2_compare", ["--plan", "--hours", "-1"], "--hours"),
]


@pytest.mark.parametrize("module, argv, flag", CASES, ids=[f"{m.rsplit('.', 1)[1]} {a[-1]}" for m, a, _ in CASES])
def test_a_bad_input_is_one_line_and_exit_2(tmp_path, module, argv, flag):
    plugin_tools.test_a_bad_input_is_one_line_and_exit_2(tmp_path, module, argv, flag)
