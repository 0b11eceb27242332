"""fs_overrides quotes only values that begin with "client", as Python string literals that read back unchanged."""

import ast
from pathlib import Path

import pytest

from research.harness.fs_command import fs_overrides


def test_only_values_beginning_with_client_are_quoted_and_read_back_unchanged():
    opts = ["fedpa.dp.mode", "client", "client_cfg_key", "x", "a.b", "clients_x", "c", "sample", "d", ""]
    out = fs_overrides(opts)
    assert out[0::2] == opts[0::2]  # keys untouched, "client"-prefixed keys too
    assert out[1::2] == ["'client'", "x", "'clients_x'", "sample", ""]
    assert [ast.literal_eval(out[1]), ast.literal_eval(out[5])] == ["client", "clients_x"]
    assert not any(w.startswith("client") for w in out[1::2])


def test_the_protocol_runner_launches_fs_with_quoted_client_values(tmp_path, monkeypatch):
    import pytest

    from research.harness import compare

    seen = []

    def popen(cmd, **kwargs):
        seen.append(cmd)
        raise OSError("not launched")

    monkeypatch.setattr(compare.subprocess, "Popen", popen)
    cell = compare.Cell("c", "fedpa", ("fedpa.dp.mode", "client", "fedpa.dp.epsilon", "8"))
    with pytest.raises(OSError):
        compare.run_one("cfg.yaml", cell, 1, tmp_path / "out", ["data.root", "/d"], "3")
    (cmd,) = [c for c in seen if "federatedscope.main" in c]  # the runner also asks git for the commit first
    assert cmd[cmd.index("fedpa.dp.mode") + 1] == "'client'" and cmd[cmd.index("fedpa.dp.epsilon") + 1] == "8"


def test_optimizer_keys_fs_defines_only_by_yaml_go_into_a_copy_of_the_config_that_fs_reads_back(tmp_path):
    import pytest
    import yaml

    from research.harness.fs_command import with_yaml_keys

    base = tmp_path / "base.yaml"
    base.write_text("train:\n  optimizer:\n    type: AdamW\n    lr: 0.002\nseed: 3\n")
    opts = ["train.optimizer.type", "SGD", "train.optimizer.momentum", "0.5", "seed", "1",
            "train.optimizer.momentum", "0.9", "train.optimizer.lr", "0.02"]  # fmt: skip
    cfg, kept = with_yaml_keys(str(base), opts, tmp_path / "run")
    assert kept == ["train.optimizer.type", "SGD", "seed", "1", "train.optimizer.lr", "0.02"]  # the last value wins
    optimizer = yaml.safe_load(Path(cfg).read_text())["train"]["optimizer"]
    assert optimizer == {"type": "AdamW", "lr": 0.002, "momentum": 0.9}
    assert with_yaml_keys(str(base), kept, tmp_path / "x") == (str(base), kept)  # nothing to move: unchanged
    fs = pytest.importorskip("federatedscope.core.configs.config", reason="FederatedScope is not installed")
    # stock FS: the command line refuses the key, the copied yaml carries it to torch.optim's arguments
    with pytest.raises(KeyError):
        fs.global_cfg.clone().merge_from_list(["train.optimizer.momentum", 0.9])
    cfg_node = fs.global_cfg.clone()
    cfg_node.merge_from_file(cfg)
    cfg_node.merge_from_list(kept)
    assert (cfg_node.train.optimizer.type, cfg_node.train.optimizer.momentum, cfg_node.seed) == ("SGD", 0.9, 1)


def test_dp_mode_client_survives_fs_command_line_through_the_launchers_quoting():
    # FS's main splits its overrides with parse_client_cfg, which takes any word beginning with "client" (values too)
    # for the client config; the launchers' fs_overrides quotes such a value so FS reads back the same string
    pytest.importorskip("federatedscope", reason="FederatedScope (branch llm) is not importable")
    from federatedscope.core.cmd_args import parse_client_cfg
    from federatedscope.core.configs.config import global_cfg

    opts = ["fedpa.dp.mode", "client", "fedpa.dp.epsilon", "8", "fedpa.dp.clip", "0.5"]
    raw, _ = parse_client_cfg(list(opts))
    assert raw == ["fedpa.dp.mode", "8", "fedpa.dp.clip", "0.5"]  # FS's own split loses the value unquoted
    cfg_opts, client_opts = parse_client_cfg(fs_overrides(opts))
    assert client_opts == []
    cfg = global_cfg.clone()
    cfg.merge_from_list(cfg_opts)
    assert (cfg.fedpa.dp.mode, cfg.fedpa.dp.epsilon, cfg.fedpa.dp.clip) == ("client", 8.0, 0.5)
