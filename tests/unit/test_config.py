"""FedPAConfig: every invalid value gets a clear error; the docs table lists every key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fs_fedpa.config import FedPAConfig
from fs_fedpa.config_sections import RecordsConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lam=-1.0), r"fedpa.lam\(=-1.0\) must be a finite number >= 0"),
        (dict(lam=float("nan")), r"fedpa.lam\(=nan\)"),
        (dict(lam="1"), r"fedpa.lam\(='1'\)"),
        (dict(reg="l2"), r"fedpa.reg\(='l2'\) must be one of"),
        (dict(svd="qr"), r"fedpa.svd\(='qr'\) must be one of"),
        (dict(oversample=-1), r"fedpa.oversample\(=-1\) must be an int >= 0"),
        (dict(client_ranks=[2, 0]), r"fedpa.client_ranks\[1\]\(=0\) must be an int >= 1"),
        (dict(reference_ranks="4"), r"fedpa.reference_ranks\(='4'\) must be a list"),
        (dict(group_sizes=[3, -1]), r"fedpa.group_sizes\[1\]\(=-1\)"),
        (dict(adaptive_lam="cos"), r"fedpa.adaptive_lam\(='cos'\) must be one of"),
        (dict(track="comet"), r"^fedpa.track\(='comet'\) must be one of \('none', 'tensorboard', 'wandb', 'mlflow'\)"),
        (dict(adaptive_lam="grad", reg="b"), r"adapts the product penalty; it needs fedpa.reg 'product'"),
        (dict(lam_min=2.0, lam_max=1.0), r"fedpa.lam_max\(=1.0\) must be > fedpa.lam_min\(=2.0\)"),
        (dict(eval={"local": "yes"}), r"fedpa.eval.local must be True or False"),
        (dict(net={"client_timeout_s": 10.0, "round_timeout_s": 20.0}), r"net.client_timeout_s\(=10\) must exceed"),
        (dict(store={"state_budget_mb": -1}), r"fedpa.store.state_budget_mb\(=-1\) must be a finite number >= 0"),
        (dict(seed=-2), r"fedpa.seed\(=-2\) must be an int >= -1"),
        (dict(lam=1e300), r"fedpa.lam\(=1e\+300\) must be <= 1e\+06"),
        (dict(lam_max=1e7), r"fedpa.lam_max\(=1e\+07\) must be <= 1e\+06"),
        (dict(seed=10**23), r"fedpa.seed\(=100000000000000000000000\) must be <= 2\*\*32 - 1"),
        (dict(seed=2**32), r"fedpa.seed\(=4294967296\) must be <= 2\*\*32 - 1"),
    ],
)
def test_invalid_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedPAConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(clip=1.0), dict(noise_multiplier=1.0), dict(epsilon=8.0), dict(delta=1e-6), dict(horizon=21), dict(seed=3),
     dict(clip=1.0, epsilon=8.0)],
)  # fmt: skip
def test_dp_keys_without_dp_are_refused_naming_them(kwargs):
    """Before, a DP key with dp.mode none trained without DP, with no warning and no ledger."""
    with pytest.raises(ValueError, match=r"set while fedpa.dp.mode is 'none'") as err:
        FedPAConfig(dp=kwargs)
    assert all(f"fedpa.dp.{k}=" in str(err.value) for k in kwargs)
    target = {} if "noise_multiplier" in kwargs else {"epsilon": 8.0}
    FedPAConfig(dp={"mode": "sample", "clip": 1.0, **target, **kwargs})  # the same keys with DP: fine


def test_the_bounds_themselves_are_accepted():
    cfg = FedPAConfig(lam=1e6, lam_max=1e6, seed=2**32 - 1)
    assert (cfg.lam, cfg.lam_max, cfg.seed) == (1e6, 1e6, 2**32 - 1)


def test_per_client_ranks_and_groups():
    assert FedPAConfig().per_client("client_ranks", 3) == []
    assert FedPAConfig(client_ranks=[2, 4, 8]).per_client("client_ranks", 3) == [2, 4, 8]
    cfg = FedPAConfig(client_ranks=[2, 4, 16], reference_ranks=[1, 2, 4], group_sizes=[7, 7, 6])
    assert cfg.per_client("client_ranks", 20) == [2] * 7 + [4] * 7 + [16] * 6
    assert cfg.per_client("reference_ranks", 20)[-1] == 4


@pytest.mark.parametrize(
    "kwargs,n,match",
    [
        (dict(client_ranks=[2, 4]), 3, r"fedpa.client_ranks has 2 values for federate.client_num\(=3\) clients"),
        (dict(client_ranks=[2, 4], group_sizes=[1, 1, 1]), 3, r"has 2 values but fedpa.group_sizes names 3 groups"),
        (dict(client_ranks=[2, 4], group_sizes=[1, 1]), 3, r"group_sizes \[1, 1\] sum to 2, not federate.client_num"),
        (dict(reg="a", client_ranks=[2, 4, 4], reference_ranks=[2, 2, 4]), 3, r"needs reference_ranks =="),
        (dict(reg="both", client_ranks=[2, 4, 4]), 3, r"set reference_ranks equal to them"),
    ],
)
def test_client_checks(kwargs, n, match):
    with pytest.raises(ValueError, match=match):
        FedPAConfig(**kwargs).check_clients(n, adapter_rank=4)


def test_docs_tables_are_the_code_s_and_list_every_key_with_its_default():
    from fs_fedpa.plugin.config_fs import describe_all
    from fs_fedpa.tools import config_doc

    text = DOCS.read_text(encoding="utf-8")
    assert config_doc.rebuilt(text) == text, "docs/config.md is stale: run python -m fs_fedpa.tools.config_doc"
    rows = dict(re.findall(r"^\| `([a-z_.]+)` \| `([^`]*)` \|", text, flags=re.M))
    for key, default, _ in describe_all():  # independent of the generator: each key's row, from the fields
        assert rows.get(key) == default, f"docs/config.md gives fedpa.{key} default {rows.get(key)}, code {default}"
    assert {"net.round_timeout_s", "hetlora.gamma", "ravan.heads", "fedrot_lora.strength"} <= set(rows)


def test_config_gaps_fail_with_their_message():
    with pytest.raises(ValueError, match=r"fedpa.num_threads\(=100000\) > the"):
        FedPAConfig(num_threads=100000)
    with pytest.raises(ValueError, match="group_sizes .* neither fedpa.client_ranks nor fedpa.reference_ranks"):
        FedPAConfig(group_sizes=[2, 1])
    assert FedPAConfig(group_sizes=[2, 1], reference_ranks=[2, 4]).group_sizes == [2, 1]


def test_a_fedpa_section_under_another_method_is_named_in_one_warning(monkeypatch):
    from types import SimpleNamespace

    from fs_fedpa.plugin import config_fs as plugin_config

    warned = []
    monkeypatch.setattr(plugin_config, "_WARNED", set())  # fresh: other tests may have warned in this process
    monkeypatch.setattr(plugin_config.logger, "warning", warned.append)  # FS may have cut its logger from the root
    fedpa = plugin_config.default_node()
    cfg = SimpleNamespace(federate=SimpleNamespace(method="FedAvg"), fedpa={**fedpa, "lam": 0.3})
    plugin_config.check_fedpa_cfg(cfg)
    plugin_config.check_fedpa_cfg(cfg)  # FS checks at every merge: one warning
    assert len(warned) == 1 and "fedpa.lam" in warned[0] and "'FedAvg'" in warned[0] and "is ignored" in warned[0]
    plugin_config.check_fedpa_cfg(SimpleNamespace(federate=SimpleNamespace(method="FedAvg"), fedpa=fedpa))
    assert len(warned) == 1  # defaults only: nothing to warn about


def test_a_misspelt_method_beside_a_fedpa_section_is_refused_with_the_nearest_name(monkeypatch):
    from types import SimpleNamespace

    from fs_fedpa.plugin import config_fs as plugin_config

    fedpa = plugin_config.default_node()
    for method, nearest in (("fedpaa", "'fedpa'"), ("FedAvgg", "'fedavg'"), ("fed_svd", "'fedsvd'")):
        cfg = SimpleNamespace(federate=SimpleNamespace(method=method), fedpa={**fedpa, "lam": 0.3})
        with pytest.raises(ValueError, match=f"federate.method '{method}' is neither .* did you mean {nearest}"):
            plugin_config.check_fedpa_cfg(cfg)
    cfg = SimpleNamespace(federate=SimpleNamespace(method="zzz"), fedpa={**fedpa, "lam": 0.3})
    with pytest.raises(ValueError, match="this plugin's methods: .*fedpa"):
        plugin_config.check_fedpa_cfg(cfg)
    with pytest.raises(ValueError, match="did you mean 'fedpa'"):  # near a plugin method: refused even unset
        plugin_config.check_fedpa_cfg(SimpleNamespace(federate=SimpleNamespace(method="fedpaa"), fedpa=fedpa))
    plugin_config.check_fedpa_cfg(SimpleNamespace(federate=SimpleNamespace(method="zzz"), fedpa=fedpa))  # FS's call


def test_multi_process_standalone_is_refused_with_the_distributed_recipe():
    from types import SimpleNamespace

    from fs_fedpa.plugin import config_fs as plugin_config

    fedpa = plugin_config.default_node()
    federate = SimpleNamespace(method="fedpa", use_ss=False, online_aggr=False, process_num=2, mode="standalone")
    with pytest.raises(ValueError) as err:
        plugin_config.check_fedpa_cfg(SimpleNamespace(federate=federate, fedpa=fedpa))
    message = str(err.value)
    assert "does not support multi-process standalone (process_num > 1); unset federate.process_num" in message
    assert "torch.distributed" in message and "state_dict" in message  # why: FS's runner ships state_dict tensors
    assert "scripts/run_distributed.sh" in message and "GPUS=0,1" in message  # what instead
    assert (DOCS.parents[1] / "scripts" / "run_distributed.sh").is_file()


@pytest.mark.parametrize("client,join,refused", [(60.0, 3600.0, True), (4000.0, 8000.0, True), (60.0, 0.0, True),
                                                 (9000.0, 3600.0, False), (0.0, 3600.0, False)])  # fmt: skip
def test_a_client_timeout_below_the_join_bound_is_refused(client, join, refused):
    """A red team found honest clients leaving first (client_timeout_s 60 against the default join bound 3600)
    while the server waited for a refused client, hearing only that the server was gone; a warning let it run."""
    from types import SimpleNamespace

    from fs_fedpa.plugin import config_fs as plugin_config

    fedpa = plugin_config.default_node()
    fedpa["net"].update(client_timeout_s=client, join_timeout_s=join, round_timeout_s=30.0)
    federate = SimpleNamespace(method="fedpa", use_ss=False, online_aggr=False, process_num=1, mode="distributed",
                               total_round_num=2, client_num=0)  # fmt: skip
    cfg = SimpleNamespace(federate=federate, fedpa=fedpa, train=SimpleNamespace(is_enable_half=False),
                          use_gpu=False)  # fmt: skip
    try:
        plugin_config.check_fedpa_cfg(cfg)
    except AttributeError:  # later checks read keys this stub lacks; this one comes first
        message = ""
    except ValueError as err:
        message = str(err)
    assert ("shorter than the server's join bound" in message) == refused


@pytest.mark.parametrize("given, level", [("light", "light"), ("full", "full"), ("off", "off"), (True, "full"),
                                          (False, "off")])  # fmt: skip
def test_diagnostics_levels_and_the_flag_they_were(given, level):
    """``fedpa.records.diagnostics``: light (the default), full or off; the True/False it was before read as full
    and off; anything else refused naming the key."""
    records = RecordsConfig(diagnostics=given)
    assert records.diagnostics == level
    assert records.full == (level == "full") and records.written == (level != "off")
    assert RecordsConfig().diagnostics == "light"


def test_an_unknown_diagnostics_level_is_refused():
    with pytest.raises(ValueError, match="fedpa.records.diagnostics must be one of light, full, off"):
        RecordsConfig(diagnostics="some")


@pytest.mark.parametrize("key,value", [("noise_multiplier", 1e308), ("clip", 1e300), ("noise_multiplier", 1.5e6)])
def test_a_noise_multiplier_or_clip_beyond_1e6_is_refused(key, value):
    """Issue 88: z 1e308 and dp.clip 1e300 were accepted and overflowed later, in the noise z C."""
    dp = {"mode": "sample", "clip": 1.0, "noise_multiplier": 1.0, key: value}
    with pytest.raises(ValueError, match=re.escape(f"fedpa.dp.{key}(={value:g}) must be <= 1e+06: the noise z C would")):
        FedPAConfig(dp=dp)
    FedPAConfig(dp={**dp, key: 1e6})  # the bound itself
