"""fs_overrides quotes only values that begin with "client", as Python string literals that read back unchanged."""

import ast

from fs_fedpa.fs_command import fs_overrides


def test_only_values_beginning_with_client_are_quoted_and_read_back_unchanged():
    opts = ["fedpa.dp_mode", "client", "client_cfg_key", "x", "a.b", "clients_x", "c", "sample", "d", ""]
    out = fs_overrides(opts)
    assert out[0::2] == opts[0::2]  # keys untouched, "client"-prefixed keys too
    assert out[1::2] == ["'client'", "x", "'clients_x'", "sample", ""]
    assert [ast.literal_eval(out[1]), ast.literal_eval(out[5])] == ["client", "clients_x"]
    assert not any(w.startswith("client") for w in out[1::2])


def test_the_protocol_runner_launches_fs_with_quoted_client_values(tmp_path, monkeypatch):
    import pytest

    from fs_fedpa import compare

    seen = []

    def popen(cmd, **kwargs):
        seen.append(cmd)
        raise OSError("not launched")

    monkeypatch.setattr(compare.subprocess, "Popen", popen)
    cell = compare.Cell("c", "fedpa", ("fedpa.dp_mode", "client", "fedpa.dp_epsilon", "8"))
    with pytest.raises(OSError):
        compare.run_one("cfg.yaml", cell, 1, tmp_path / "out", ["data.root", "/d"], "3")
    (cmd,) = [c for c in seen if "federatedscope.main" in c]  # the runner also asks git for the commit first
    assert cmd[cmd.index("fedpa.dp_mode") + 1] == "'client'" and cmd[cmd.index("fedpa.dp_epsilon") + 1] == "8"
