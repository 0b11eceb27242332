"""Issue 88, options and values, through FS's own config (in process, no run): an option that would act outside the
DP mechanism is refused naming its key (or, for FedDPA's instance mix, warned), a float for an int key is refused
before FS truncates it, an old flat key given at its default still disagrees with its nested key, an unknown method
beside a fedpa section at its defaults is refused, and pack_len is bounded and refused where nothing reads it."""

from __future__ import annotations

import pytest

pytest.importorskip("federatedscope", reason="the checks read FS's config (FS not installed)")
pytest.importorskip("dp_accounting", reason="a DP run's check needs dp-accounting")

from fs_fedpa.plugin import config_fs  # noqa: E402

DP = ["federate.method", "fedit", "early_stop.patience", 0, "eval.split", ["val"], "fedpa.dp.mode", "sample",
      "fedpa.dp.clip", 1.0, "fedpa.dp.noise_multiplier", 1.0]  # fmt: skip


def _fresh():
    from federatedscope.core.configs.config import global_cfg

    return global_cfg.clone()


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "opts,fine,message",
    [
        (["eval.split", ["val", "train"]], DP[:6], r"eval.split \['val', 'train'\] with differential privacy .* training"),
        (["early_stop.patience", 5], DP[:6], r"early_stop.patience\(=5\) with differential privacy .* early_stop.patience 0"),
        (["federate.make_global_eval", True], DP[:6], r"federate.make_global_eval with differential privacy .* every"),
        (["federate.merge_test_data", True], DP[:6], r"federate.merge_test_data with differential privacy"),
        (["fedpa.dp.accountant", "pld", "train.local_update_steps", 10**6, "federate.total_round_num", 2],
         [*DP, "fedpa.dp.accountant", "pld", "train.local_update_steps", 10**6, "federate.total_round_num", 1],
         r"the PLD accountant composes at most 1,000,000 events and this needs 2,000,000"),
    ],
)  # fmt: skip
def test_an_option_outside_the_dp_guarantee_is_refused_naming_its_key(opts, fine, message):
    """Before, each was accepted silently under DP: training-set metrics, FS's early stop on the clients' metrics,
    the server's evaluation on every client's data, and a PLD ledger of 2e6 steps, all ran."""
    with pytest.raises(ValueError, match=message):
        _fresh().merge_from_list([*DP, *opts])
    _fresh().merge_from_list([*fine, *opts[:2]])  # without DP (or at the bound): fine


@pytest.mark.parametrize("method", ["feddpa_t", "feddpa_f"])
def test_feddpa_s_instance_mix_under_dp_sgd_is_warned_as_outside_the_guarantee(method, monkeypatch):
    from fs_fedpa.privacy import run_checks

    seen: list[str] = []
    monkeypatch.setattr(run_checks, "_WARNED", set())
    monkeypatch.setattr(run_checks.logger, "warning", seen.append)
    _fresh().merge_from_list([*DP, "federate.method", method])
    assert len(seen) == 1 and f"federate.method {method} under DP-SGD" in seen[0] and "OUTSIDE the guarantee" in seen[0]
    seen.clear()
    _fresh().merge_from_list([*DP, "federate.method", "fedit"])
    assert not seen


@pytest.mark.parametrize("key,value", [("federate.total_round_num", 2.9), ("fedpa.dp.min_records", 2.7),
                                       ("train.local_update_steps", 0.5)])  # fmt: skip
def test_a_float_for_an_int_key_is_refused_before_fs_truncates_it(key, value, tmp_path):
    """Before, FS's coercion read 2.9 as 2 and 2.7 as 2 without a word."""
    with pytest.raises(ValueError, match=rf"{key}\(={value!r}\) must be an integer: FederatedScope would truncate"):
        _fresh().merge_from_list([key, value])
    with pytest.raises(ValueError, match=rf"{key}\(={value!r}\) must be an integer"):  # the command line's string
        _fresh().merge_from_list([key, str(value)])
    section, name = key.rsplit(".", 1)
    nested = "".join(f"{'  ' * i}{part}:\n" for i, part in enumerate(section.split(".")))
    with pytest.raises(ValueError, match=rf"{key}\(={value!r}\) must be an integer"):
        _fresh().merge_from_file(_yaml(tmp_path, f"{nested}{'  ' * len(section.split('.'))}{name}: {value}\n"))
    cfg = _fresh()
    cfg.merge_from_list(["federate.total_round_num", 3.0])  # an integral float is an integer: FS's own reading
    assert cfg.federate.total_round_num == 3 and isinstance(cfg.federate.total_round_num, int)


def test_an_old_flat_key_given_at_its_default_still_disagrees_with_its_nested_key(tmp_path):
    """``fedpa.dp_mode none`` on the command line beside a yaml's ``dp: {mode: sample}`` left DP on without a word:
    the old key at its default read as unset."""
    yaml = _yaml(tmp_path, "fedpa:\n  dp:\n    mode: sample\n    clip: 1.0\n    noise_multiplier: 1.0\n")
    cfg = _fresh()
    cfg.merge_from_file(yaml)
    with pytest.raises(ValueError, match=r"fedpa.dp_mode \(the old name of fedpa.dp.mode\) is 'none' and "
                                         r"fedpa.dp.mode is 'sample': keep fedpa.dp.mode only"):  # fmt: skip
        cfg.merge_from_list(["fedpa.dp_mode", "none"])
    with pytest.raises(ValueError, match="fedpa.eval_local .* is True and fedpa.eval.local is False"):
        _fresh().merge_from_list(["fedpa.eval.local", False, "fedpa.eval_local", True])
    agree = _fresh()
    agree.merge_from_file(yaml)
    agree.merge_from_list(["fedpa.dp_mode", "sample", "seed", 1])  # the same value: moved once, not refused later
    assert agree.fedpa.dp.mode == "sample"


@pytest.mark.parametrize("section", ["fedpa:\n  lam: 1.0\n", "fedpa: {}\n"])
def test_an_unknown_method_beside_a_fedpa_section_at_its_defaults_is_refused(section, tmp_path):
    """``federate.method fedavgg`` beside a fedpa section whose values are the defaults trained FedAvg, exit 0."""
    with pytest.raises(ValueError, match=r"federate.method 'fedavgg' is neither a method of fs_fedpa .* the run sets "
                                         r"the fedpa section .* did you mean 'fedavg'\? this plugin's methods: .*fedpa"):
        _fresh().merge_from_file(_yaml(tmp_path, f"federate:\n  method: fedavgg\n{section}"))
    _fresh().merge_from_file(_yaml(tmp_path, f"federate:\n  method: FedAvg\n{section}"))  # FS's own: as before
    _fresh().merge_from_file(_yaml(tmp_path, "federate:\n  method: fedavgg\n"))  # no section: FS's call


@pytest.mark.parametrize(
    "opts,message",
    [
        (["model.seqcls.pack_len", 1000000], r"model.seqcls.pack_len\(=1000000\) must be <= 8192"),
        (["model.type", "gpt2@huggingface_llm", "model.seqcls.pack_len", 64],
         r"packs the records of a '@seqcls_llm' encoder only; model.type 'gpt2@huggingface_llm' would ignore it"),
    ],
)  # fmt: skip
def test_pack_len_is_bounded_and_refused_where_nothing_reads_it(opts, message):
    """Before, 1,000,000 asked for a TB at the first forward, and a causal LM ignored pack_len silently."""
    with pytest.raises(ValueError, match=message):
        _fresh().merge_from_list(opts)
    _fresh().merge_from_list(["model.type", "x@seqcls_llm", "model.seqcls.pack_len", 8192])


def test_the_keys_given_are_kept_per_config_and_by_its_clones():
    cfg = _fresh()
    cfg.merge_from_list(["fedpa.lam", 1.0])
    assert "fedpa.lam" in config_fs.given_keys(cfg) and "fedpa.lam" in config_fs.given_keys(cfg.clone())
    assert "fedpa.lam" not in config_fs.given_keys(_fresh())
    dp = _fresh()
    dp.merge_from_list(DP)
    dp.merge_from_other_cfg(dp.clone())  # FS's main merges its data-modified clone back: old keys at default stay unset
    assert dp.fedpa.dp.mode == "sample" and "fedpa.dp_mode" not in config_fs.given_keys(dp)


def test_fs_own_wandb_logging_is_refused_naming_the_plugin_tracker():
    """FS's ``wandb.use True`` would start a second W&B run beside ``fedpa.track wandb`` (online, with credentials),
    one that never sees the plugin's diagnostics."""
    with pytest.raises(ValueError, match=r"federate.method 'fedpa' does not support FederatedScope's W&B logging "
                                         r"\(wandb.use True\); unset wandb.use: .* Use fedpa.track wandb instead"):
        _fresh().merge_from_list(["federate.method", "fedpa", "wandb.use", True])
    _fresh().merge_from_list(["federate.method", "fedpa", "fedpa.track", "wandb"])
    _fresh().merge_from_list(["federate.method", "FedAvg", "wandb.use", True])  # FS's own method: FS's own logging


def test_keep_moments_parses_beside_the_flat_dp_keys_and_is_refused_with_a_personal_phase():
    """fedpa.keep_moments as the study passes it (a string, beside the old flat fedpa.dp_* keys), and refused where a
    personal phase trains a second adapter each round (FedDPA)."""
    from fs_fedpa.plugin.config_fs import fedpa_config

    flat = ["federate.method", "fedpa", "early_stop.patience", 0, "eval.split", ["val"], "fedpa.dp_mode", "sample",
            "fedpa.dp_clip", "0.01", "fedpa.dp_epsilon", "8", "fedpa.dp_horizon", "120", "fedpa.keep_moments", "True"]
    cfg = _fresh()
    cfg.merge_from_list(flat)
    assert fedpa_config(cfg).keep_moments is True and fedpa_config(_fresh()).keep_moments is False
    with pytest.raises(ValueError, match=r"fedpa.keep_moments with federate.method 'feddpa_t': its personal phase"):
        _fresh().merge_from_list([*flat, "federate.method", "feddpa_t"])
    with pytest.raises(ValueError, match=r"fedpa.keep_moments"):  # FS's own type check names it
        _fresh().merge_from_list(["fedpa.keep_moments", "1.5"])
