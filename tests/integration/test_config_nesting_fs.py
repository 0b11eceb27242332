"""The ``fedpa:`` section nested by concern, through FS's own config: every old flat key lands where its new key
does (with one warning naming it), an old and a new key that disagree are refused, and FS's --help prints a nested
key's help from the field's metadata."""

from __future__ import annotations

import contextlib
import io
import logging

import pytest

pytest.importorskip("federatedscope", reason="the nested fedpa node is FS's config (FS not installed)")

from fs_fedpa.plugin import config_fs  # noqa: E402


def _fresh():
    from federatedscope.core.configs.config import global_cfg

    return global_cfg.clone()


def _changed_value(default):
    """A valid value other than ``default``, by its type (every moved key takes one of these)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2 if default else 0.5
    if isinstance(default, list):
        return [1, 2]
    if default == "light":  # fedpa.records.diagnostics: a level, not a path
        return "full"
    return "some/file"


@pytest.fixture
def warnings_seen(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(config_fs, "_WARNED", set())
    monkeypatch.setattr(config_fs.logger, "warning", seen.append)
    return seen


# values the type's default rule would not give a valid one for; a DP key is set inside a DP setting (below)
VALUES = {"dp.mode": "sample", "dp.delta": 1e-6, "dp.sampling": "poisson", "dp.accountant": "pld",
          "dp.local_tensors": "frozen", "dp.epsilon": 8.0}  # fmt: skip
DP_CONTEXT = {"mode": "sample", "clip": 1.0, "noise_multiplier": 1.0}


def _context(name: str) -> list:
    """The other DP keys a DP key needs beside it (by their new names), without the key itself; with a target
    epsilon, no noise multiplier."""
    keys = {k: v for k, v in DP_CONTEXT.items() if k != name and not (name == "epsilon" and k == "noise_multiplier")}
    return [x for k, v in keys.items() for x in (f"fedpa.dp.{k}", v)]


@pytest.mark.parametrize("old,new", sorted(config_fs.flat_keys().items()))
def test_an_old_flat_key_lands_where_its_new_key_does_with_one_warning(old, new, warnings_seen):
    part, name = new.split(".")
    value = VALUES.get(new, _changed_value(config_fs.default_node()[part][name]))
    context = _context(name) if part == "dp" else []
    by_old, by_new = _fresh(), _fresh()
    by_old.merge_from_list([*context, f"fedpa.{old}", value])
    by_new.merge_from_list([*context, f"fedpa.{new}", value])
    assert by_old.fedpa[part][name] == by_new.fedpa[part][name] == value
    assert config_fs.fedpa_config(by_old) == config_fs.fedpa_config(by_new)
    assert by_old.fedpa[old] == config_fs.default_node()[old]  # moved, not kept twice
    deprecations = [w for w in warnings_seen if "deprecated" in w]
    assert deprecations == [f"fedpa.{old} is deprecated and will be removed: write fedpa.{new} (docs/config.md)"]
    by_old.merge_from_list(["seed", 1])  # FS checks at every merge: the key already moved, no second warning
    assert len([w for w in warnings_seen if "deprecated" in w]) == 1


def test_a_yaml_with_old_keys_reads_as_its_nested_twin(tmp_path, warnings_seen):
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("fedpa:\n  round_timeout_s: 60.0\n  export_dir: out/adapter\n  hetlora_gamma: 0.5\n")
    nested.write_text("fedpa:\n  net:\n    round_timeout_s: 60.0\n  export:\n    dir: out/adapter\n"
                      "  hetlora:\n    gamma: 0.5\n")  # fmt: skip
    a, b = _fresh(), _fresh()
    a.merge_from_file(str(flat))
    b.merge_from_file(str(nested))
    assert config_fs.fedpa_config(a) == config_fs.fedpa_config(b)
    assert config_fs.fedpa_config(a).methods["hetlora"].gamma == 0.5 and a.fedpa.export.dir == "out/adapter"


def test_the_runs_config_yaml_holds_each_value_once_under_its_nested_key_and_reruns_as_the_run(tmp_path):
    """FS's freeze writes config.yaml: the old flat keys are left out (at their defaults they would contradict the
    nested values), every nested value is there, and the file merged into a fresh config gives the same section.
    A part key that shares its name with an old key (store.checkpoint; old key checkpoint) stays."""
    import yaml

    cfg = _fresh()
    cfg.merge_from_list(["outdir", str(tmp_path), "fedpa.eval_local", False, "fedpa.net.round_timeout_s", 60.0,
                         "fedpa.store.checkpoint", False, "fedpa.hetlora.gamma", 0.5])  # fmt: skip
    cfg.freeze()
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["fedpa"]
    assert not set(saved) & set(config_fs.flat_keys()), "an old flat key is in config.yaml"
    assert saved["eval"]["local"] is False and saved["net"]["round_timeout_s"] == 60.0
    assert saved["store"]["checkpoint"] is False and saved["hetlora"]["gamma"] == 0.5
    assert "eval_local" in cfg.fedpa  # the live node keeps the old keys, so a yaml that names them still merges
    again = _fresh()
    again.merge_from_file(str(tmp_path / "config.yaml"))
    assert config_fs.fedpa_config(again) == config_fs.fedpa_config(cfg)  # its methods' options too (a field)


def test_an_old_key_and_its_new_one_that_disagree_are_refused():
    cfg = _fresh()
    with pytest.raises(ValueError, match=r"fedpa.export_dir \(the old name of fedpa.export.dir\) is 'b' and "
                                         r"fedpa.export.dir is 'a': keep fedpa.export.dir only"):  # fmt: skip
        cfg.merge_from_list(["fedpa.export.dir", "a", "fedpa.export_dir", "b"])
    agree = _fresh()
    agree.merge_from_list(["fedpa.export.dir", "a", "fedpa.export_dir", "a"])  # the same value: nothing to choose
    assert agree.fedpa.export.dir == "a"


def test_a_bad_nested_value_is_refused_naming_its_dotted_key():
    with pytest.raises(ValueError, match=r"fedpa.net.min_received\(=0\) must be an int >= 1"):
        _fresh().merge_from_list(["fedpa.net.min_received", 0])
    with pytest.raises(ValueError, match=r"fedpa.hetlora.gamma\(=1.5\) must be in \(0, 1\)"):
        _fresh().merge_from_list(["fedpa.hetlora.gamma", 1.5])
    with pytest.raises(AssertionError, match="Non-existent key: fedpa.net.round_timeout"):  # FS's own refusal
        _fresh().merge_from_list(["fedpa.net.round_timeout", 1.0])


def test_a_method_s_own_keys_set_for_another_method_give_one_warning(warnings_seen):
    cfg = _fresh()
    cfg.merge_from_list(["federate.method", "fedpa", "fedpa.ravan.head_rank", 2])
    assert any("fedpa.ravan.head_rank set, but federate.method 'fedpa' does not read them" in w for w in warnings_seen)
    warnings_seen.clear()
    cfg.merge_from_list(["federate.method", "ravan"])
    assert not [w for w in warnings_seen if "does not read" in w]


def test_fs_help_prints_a_nested_key_s_help_from_its_field(monkeypatch):
    from federatedscope.core.cmd_args import parse_args

    from fs_fedpa.config_sections import NetConfig

    out = io.StringIO()
    monkeypatch.setattr("sys.argv", ["main.py", "--help", "fedpa.net.round_timeout_s"])
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            parse_args()
    finally:
        logging.disable(logging.NOTSET)
    expected = NetConfig.__dataclass_fields__["round_timeout_s"].metadata["help"]
    assert out.getvalue().strip() == f"--fedpa.net.round_timeout_s \t {expected}"


def test_a_resume_point_written_with_the_old_names_compares_under_the_new_ones():
    """A point written before the section was nested names its DP settings flat; read, they are the new keys, so
    the resume compares them with this run's instead of refusing every one as missing."""
    from fs_fedpa.plugin.resume_fs import named_now

    old = {"fedpa.dp_clip": 0.1, "fedpa.dp_horizon (or federate.total_round_num)": 20, "fedpa.lam": 1.0,
           "federate.client_num": 10}  # fmt: skip
    assert named_now(old) == {"fedpa.dp.clip": 0.1, "fedpa.dp.horizon (or federate.total_round_num)": 20,
                              "fedpa.lam": 1.0, "federate.client_num": 10}  # fmt: skip
