"""The ``fedpa`` CN node of FederatedScope's config, derived from :class:`fs_fedpa.config.FedPAConfig`.

Its check runs on every merge and at ``freeze()``: invalid values fail with the dataclass's
message before any data or model is built. Checks that need ``federate.*`` run only when the
run selects a method of this plugin.
"""

from __future__ import annotations

import difflib
import logging
import math
from dataclasses import fields

from fs_fedpa import config_sections as sections
from fs_fedpa.config import FedPAConfig
from fs_fedpa.methods import names

PLUGIN_METHODS = names()  # one module per method in fs_fedpa/methods; no torch import here
GIVEN = "fedpa_given"  # in the root config's __dict__: the dotted keys and sections a yaml or command line gave
logger = logging.getLogger(f"federatedscope.{__name__}")
_WARNED: set[str] = set()  # the check runs at every merge: warn once

# FS features whose message formats or update rules FedPA does not speak (yet).
_UNSUPPORTED = (
    ("federate.use_ss", lambda c: c.federate.use_ss, "secret sharing"),
    ("federate.online_aggr", lambda c: c.federate.online_aggr, "online aggregation"),
    ("federate.process_num", lambda c: c.federate.process_num > 1, "multi-process standalone (process_num > 1)"),
    ("asyn.use", lambda c: c.asyn.use, "asynchronous training"),
    ("quantization.method", lambda c: c.quantization.method != "none", "uplink quantization"),
    ("aggregator.robust_rule", lambda c: c.aggregator.robust_rule not in ("", "fedavg"), "robust aggregation rules"),
    ("model.model_num_per_trainer", lambda c: c.model.model_num_per_trainer != 1, "several models per trainer"),
    ("wandb.use", lambda c: c.wandb.use, "FederatedScope's W&B logging (wandb.use True)"),
    (
        "federate.share_local_model",
        lambda c: c.federate.mode == "distributed" and c.federate.share_local_model,
        "share_local_model in distributed mode (one client per process; FS's DistributedRunner fails on it)",
    ),
)

# What to use instead, where there is something: appended to the refusal.
_INSTEAD = {
    "wandb.use": (
        ": it would start a W&B run of its own beside the plugin's, online, with credentials. Use fedpa.track wandb "
        "instead (it logs the plugin's diagnostics too, offline unless WANDB_MODE=online)"
    ),
    "federate.process_num": (
        ". FS's multi-process standalone runner (federatedscope/core/parallel) moves every model_para message "
        "over torch.distributed as tensors shaped like the model's state_dict, and FedPA's messages are per-client "
        "payloads of LoRA factors (each client its own rank-R_i reference), not state_dicts. For one party per GPU, "
        "run distributed mode with scripts/run_distributed.sh and GPUS=0,1,... (docs/distributed.md)"
    ),
}


def _parts() -> dict[str, type]:
    """``{name: dataclass}`` of the section's nested parts: the config's own (net, store, ...) and each method's
    options (``fedpa.<method>``), which live in the methods' files."""
    from fs_fedpa.methods.base import option_parts  # torch: FS has imported it before it registers configs

    own = {f.name: f.default_factory for f in fields(FedPAConfig) if sections.is_part(f)}
    return {**own, **option_parts()}


def flat_keys() -> dict[str, str]:
    """``{old flat key: its dotted key}``, e.g. ``round_timeout_s -> net.round_timeout_s``: the one mapping by which
    yamls and command lines written before the section was nested keep working (read from the fields' ``was``)."""
    return {old: f"{name}.{new}" for name, cls in _parts().items() for old, new in sections.flat_names(cls).items()}


def extend_fedpa_cfg(cfg) -> None:
    """Add ``cfg.fedpa`` with FedPAConfig's defaults, one child node per part, each key's help in FS's --help,
    and register its check (FS ``register_config`` hook). Each old flat key stays in the node at its default, so
    that a yaml or a command line (FS's merge_from_list sets only keys the node has, of their type) can still set
    it, and the check moves a value that differs to its place; the run's ``config.yaml`` leaves them out. A key the
    node lacks fails in FS's own merge (``Non-existent key: fedpa.<key>``)."""
    from federatedscope.core.configs.config import CN

    from fs_fedpa.plugin.fs_patches import extend_clear_aux_info, extend_merges

    cfg.fedpa = CN(default_node())
    extend_clear_aux_info(cfg.fedpa, _drop_flat_keys)
    extend_merges(cfg, _before_merge)
    cfg.__dict__[GIVEN] = set()  # marks the root and its clones (FS's main merges a whole clone back)
    for key, _default, text in describe_all():
        cfg.__help_info__[f"fedpa.{key}"] = text
    cfg.register_cfg_check_fun(check_fedpa_cfg)


def _before_merge(root, pairs: list, other) -> None:
    """Before FS merges ``pairs`` (dotted key, value as given) into the root config ``root``: refuse a float that is
    not an integer for an int key (FS's coercion would truncate 2.9 to 2), then remember the keys as given. A clone
    of the root (``other``; FS's main merges its data-modified copy back) gives only the keys given to it."""
    from federatedscope.core.configs.yacs_config import Argument, CfgNode

    if isinstance(getattr(other, "__dict__", {}).get(GIVEN), set):
        root.__dict__.setdefault(GIVEN, set()).update(other.__dict__[GIVEN])
        return

    for key, raw in pairs:
        current = _lookup(root, str(key))
        current = current.value if isinstance(current, Argument) else current
        value = CfgNode._decode_cfg_value(raw) if isinstance(raw, str) else raw
        if type(current) is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{key}(={value!r}) must be an integer: FederatedScope would truncate it"
                             f"{f' to {int(value)}' if math.isfinite(value) else ''}")  # fmt: skip
    root.__dict__.setdefault(GIVEN, set()).update(str(key) for key, _ in pairs)


def _lookup(node, key: str):
    """The value at dotted ``key`` of a config, or None where it has none."""
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def given_keys(cfg) -> set[str]:
    """The dotted keys (and sections) a yaml or command line set on FS's config ``cfg`` so far; empty for a config
    not merged through FS (a test's namespace)."""
    return getattr(cfg, "__dict__", {}).get(GIVEN, set())


def _drop_flat_keys(node) -> None:
    """Leave the old flat keys out of the copy of the node that FS dumps to a run's ``config.yaml``: they sit in the
    node only so that a yaml or command line naming them still merges, and at their defaults beside the nested keys
    they would read as contradicting them (``eval_local: true`` beside ``eval: {local: false}``)."""
    for old in flat_keys():
        node.pop(old, None)


def default_node() -> dict:
    """The section's defaults as FS's node holds them: the top keys, one dict per part, and each old flat key at
    its new key's default."""
    defaults = FedPAConfig()
    node = {f.name: getattr(defaults, f.name) for f in fields(FedPAConfig) if "help" in f.metadata}
    for name, cls in _parts().items():
        node[name] = {f.name: getattr(cls(), f.name) for f in fields(cls)}
    for old, new in flat_keys().items():
        part, name = new.split(".")
        node[old] = node[part][name]
    return node


def describe_all() -> list[tuple[str, str, str]]:
    """``(dotted key, default, help)`` of every key of the section, the methods' own included (docs/config.md)."""
    from fs_fedpa.methods.base import option_parts

    return sections.describe(FedPAConfig) + [
        row for name, cls in option_parts().items() for row in sections.describe(cls, f"{name}.")
    ]


def fedpa_config(cfg) -> FedPAConfig:
    """The validated dataclass for an FS config (raises ValueError naming the bad key), each method's options in
    ``methods``."""
    from fs_fedpa.methods.base import option_parts

    fedpa = sections.build(FedPAConfig, cfg.fedpa)
    fedpa.methods = {name: sections.build(cls, cfg.fedpa[name]) for name, cls in option_parts().items()}
    return fedpa


def map_flat_keys(cfg) -> None:
    """Move every old flat key of ``cfg.fedpa`` that a yaml or command line gave, or that is off its default
    (``fedpa.round_timeout_s``), to its place (``fedpa.net.round_timeout_s``), warning once per key, and set it back;
    ValueError for an old key whose new one is given or set to another value too (``fedpa.dp_mode none`` beside
    ``dp: {mode: sample}`` is refused, not read as "unset")."""
    node, moved, parts, given = cfg.fedpa, flat_keys(), _parts(), given_keys(cfg)
    for old, new in moved.items():
        part, name = new.split(".")
        default = getattr(parts[part](), name)
        value = list(node[old]) if isinstance(node[old], tuple) else node[old]  # FedPAConfig checks its type
        if value == default and f"fedpa.{old}" not in given:
            continue
        nested = list(node[part][name]) if isinstance(node[part][name], tuple) else node[part][name]
        if nested != value and (nested != default or f"fedpa.{new}" in given):
            raise ValueError(f"fedpa.{old} (the old name of fedpa.{new}) is {value!r} and fedpa.{new} is "
                             f"{nested!r}: keep fedpa.{new} only")  # fmt: skip
        node[part][name], node[old] = value, default
        given.discard(f"fedpa.{old}")  # moved: a later merge's check must not read its default as given
        message = f"fedpa.{old} is deprecated and will be removed: write fedpa.{new} (docs/config.md)"
        if message not in _WARNED:
            _WARNED.add(message)
            logger.warning(message)


def fs_methods() -> set[str]:
    """The ``federate.method`` names FederatedScope itself knows (its constants and its worker registry)."""
    from federatedscope.core.configs import constants
    from federatedscope.register import worker_dict

    known = {*constants.AGGREGATOR_TYPE, *constants.CLIENTS_TYPE, *constants.SERVER_TYPE, *worker_dict}
    return {name.lower() for name in known} - set(PLUGIN_METHODS)


def check_fedpa_cfg(cfg) -> None:
    map_flat_keys(cfg)
    fedpa = fedpa_config(cfg)
    if cfg.federate.method.lower() not in PLUGIN_METHODS:
        _check_other_method(cfg, fedpa)
        return
    if cfg.federate.mode.lower() == "distributed" and fedpa.net.client_timeout_s > 0 and (
        fedpa.net.join_timeout_s == 0 or fedpa.net.client_timeout_s < fedpa.net.join_timeout_s
    ):
        bound = "waits forever" if fedpa.net.join_timeout_s == 0 else f"waits up to {fedpa.net.join_timeout_s:g} s"
        raise ValueError(
            f"fedpa.net.client_timeout_s(={fedpa.net.client_timeout_s:g}) is shorter than the server's join bound "
            f"(fedpa.net.join_timeout_s {bound} for a late client): while the server waits for one, the honest "
            "clients that joined give up first and only hear that the server is gone; keep client_timeout_s above "
            "join_timeout_s (docs/distributed.md)"
        )
    _warn_other_methods(cfg, fedpa)
    for key, bad, what in _UNSUPPORTED:
        if bad(cfg):
            raise ValueError(
                f"federate.method {cfg.federate.method!r} does not support {what}; unset {key}{_INSTEAD.get(key, '')}"
            )
    rounds = cfg.federate.total_round_num
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(
            f"federate.total_round_num(={rounds!r}) must be an int >= 1 (below it, FS would still train one round)"
        )
    if cfg.train.is_enable_half and not cfg.use_gpu:
        raise ValueError(
            "train.is_enable_half True on the CPU: half-precision training there turns every upload into NaN and "
            "the run would train nothing; unset it (model.seqcls.precision sets autocast for a GPU)"
        )
    if fedpa.net.tls_cert and cfg.federate.mode.lower() == "distributed":  # before the data and the model load
        from fs_fedpa.plugin import tls

        tls.read_files(fedpa.net, "server" if cfg.distribute.role == "server" else "client", cfg.federate.client_num)
    secured = fedpa.net.auth_keyring or fedpa.net.auth_key or fedpa.net.tls_cert
    if secured and cfg.federate.mode.lower() != "distributed":
        message = "fedpa.net.auth_keyring, auth_key and tls_* sign and encrypt messages in distributed mode only; "
        message += "this standalone run ignores them (its clients are code in the server's own process)"
        if message not in _WARNED:
            _WARNED.add(message)
            logger.warning(message)
    if fedpa.records.save_outcomes and cfg.trainer.type != "seqcls":
        raise ValueError(
            "fedpa.records.save_outcomes records per-example outcomes of sequence classification (trainer.type "
            f"seqcls); this run's trainer.type is {cfg.trainer.type!r}: unset fedpa.records.save_outcomes"
        )
    if fedpa.eval.refit_head and (cfg.trainer.type != "seqcls" or not list(cfg.personalization.local_param)):
        raise ValueError(
            "fedpa.eval.refit_head refits a sequence classifier's local head: it needs trainer.type seqcls and the "
            f"head in personalization.local_param (this run: {cfg.trainer.type!r}, "
            f"{list(cfg.personalization.local_param)}); unset fedpa.eval.refit_head"
        )
    if cfg.federate.client_num > fedpa.max_clients:
        hours = cfg.federate.client_num * 0.6 / 3600
        raise ValueError(
            f"federate.client_num(={cfg.federate.client_num}) is above fedpa.max_clients(={fedpa.max_clients}): FS "
            f"sets its clients up one at a time, about 0.6 s each on a CPU here ({hours:.3g} h before round 1); "
            "raise fedpa.max_clients to run it"
        )
    if cfg.federate.client_num > 0:
        fedpa.check_clients(cfg.federate.client_num, _adapter_rank(cfg))
    from fs_fedpa.methods import get_method
    from fs_fedpa.privacy import check_run, run_checks

    check_run(cfg, fedpa)  # what the run's DP mechanism refuses
    run_checks.check(cfg, fedpa, get_method(cfg.federate.method.lower()))  # and any DP run, of FS's own options
    if fedpa.keep_moments:
        personal = "personal_start" in get_method(cfg.federate.method.lower()).uses
        why = ("its personal phase trains a second adapter every round" if personal else
               "llm.deepspeed.use: deepspeed's engine keeps its own optimizer" if cfg.llm.deepspeed.use else "")
        if why:
            raise ValueError(f"fedpa.keep_moments with federate.method {cfg.federate.method!r}: {why}; unset "
                             "fedpa.keep_moments")  # fmt: skip
    if fedpa.lr_schedule != "none" and cfg.train.scheduler.type:
        raise ValueError(
            f"fedpa.lr_schedule {fedpa.lr_schedule!r} and train.scheduler.type {cfg.train.scheduler.type!r} both set "
            "the learning rate of every step; keep one"
        )


def _check_other_method(cfg, fedpa: FedPAConfig) -> None:
    """A method that is not this plugin's: refused when FS does not know it either and it looks like a misspelt
    plugin method or the run sets the fedpa section (FS would train FedAvg in its place and ignore the section);
    one warning when it is FS's own and the section is set."""
    changed = sorted(_changed(fedpa))
    method, known = cfg.federate.method.lower(), fs_methods()
    near_plugin = difflib.get_close_matches(method, PLUGIN_METHODS, n=1, cutoff=0.8)
    given = sorted(k for k in given_keys(cfg) if k == "fedpa" or k.startswith("fedpa."))  # at defaults too
    if method not in known and (changed or given or near_plugin):
        near = near_plugin or difflib.get_close_matches(method, [*PLUGIN_METHODS, *sorted(known)], n=1, cutoff=0.6)
        hint = f"did you mean {near[0]!r}? " if near else ""
        hint += f"this plugin's methods: {', '.join(PLUGIN_METHODS)}"
        keys = ", ".join(f"fedpa.{k}" for k in changed) or ", ".join([k for k in given if k != "fedpa"] or given)
        section = f", and the run sets the fedpa section ({keys})" if changed or given else ""
        raise ValueError(f"federate.method {cfg.federate.method!r} is neither a method of fs_fedpa nor one "
                         f"FederatedScope knows (FS would train FedAvg in its place){section}: {hint}")  # fmt: skip
    if changed:
        message = (
            f"the fedpa section ({', '.join(f'fedpa.{k}' for k in changed)}) is ignored: federate.method "
            f"{cfg.federate.method!r} is not a method of fs_fedpa (one of {', '.join(PLUGIN_METHODS)})"
        )
        if message not in _WARNED:
            _WARNED.add(message)
            logger.warning(message)


def _changed(fedpa: FedPAConfig) -> list[str]:
    """The dotted keys the run sets off their defaults, the methods' own included."""
    own = [f"{name}.{key}" for name, options in fedpa.methods.items() for key in sections.changed(options)]
    return sections.changed(fedpa) + own


def _warn_other_methods(cfg, fedpa: FedPAConfig) -> None:
    """One warning for a method's own keys set in a run of another method, which never reads them."""
    from fs_fedpa.methods import get_method

    reads = get_method(cfg.federate.method.lower()).options_section()
    unread = [f"fedpa.{name}.{key}" for name, options in fedpa.methods.items() if name != reads
              for key in sections.changed(options)]  # fmt: skip
    message = f"{', '.join(unread)} set, but federate.method {cfg.federate.method!r} does not read them"
    if unread and message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def _adapter_rank(cfg) -> int | None:
    """The run's LoRA rank: ``model.seqcls.r`` of a ``@seqcls_llm`` model, r of ``llm.adapter.args`` when the
    run uses FS-LLM's adapter, else None (the model decides)."""
    if str(cfg.model.type).lower().endswith("@seqcls_llm") and "seqcls" in cfg.model:
        r = cfg.model.seqcls.r
        return r if isinstance(r, int) and r > 0 else None
    try:
        args = cfg.llm.adapter.args[0] if cfg.llm.adapter.use else {}
    except (AttributeError, IndexError, KeyError):
        return None
    r = args.get("r") if isinstance(args, dict) else None
    return r if isinstance(r, int) and r > 0 else None


def _plain(value):
    """CN lists/tuples to plain lists (yacs may hand back tuples after merge_from_list)."""
    return list(value) if isinstance(value, tuple) else value
