"""What a DP run refuses (or warns about) of FederatedScope's own options, beside each mechanism's ``check_run``: the
options that would act on data outside the mechanism, and an accountant asked for more than it can compute. No
torch and no FederatedScope import: it reads FS's config as given.

Refused under any DP mode (one line naming the key):

- ``eval.split`` with ``train``: every client would send the server metrics of its training records;
- ``early_stop.patience > 0`` (FS's default is 5): FS ends the run on the clients' evaluation metrics, so how many
  rounds are released would depend on data the guarantee does not cover;
- ``federate.make_global_eval`` (or ``federate.merge_test_data``, which sets it): FS's server evaluates on its own
  copy of the data, which in a standalone run is every client's splits merged, training records included;
- the PLD accountant over more than :data:`~fs_fedpa.privacy.accountant.PLD_MAX_EVENTS` steps.

Warned under DP-SGD (``fedpa.dp.mode sample``), since the trained adapters stay inside the guarantee: FedDPA-T/F's
instance mix weighs each test input by its similarity to some of the client's raw training inputs, so their
paper-protocol scores (and predictions with an export's ``mix``) read training records outside the mechanism.
"""

from __future__ import annotations

import logging

from fs_fedpa.privacy import registry

logger = logging.getLogger(f"federatedscope.{__name__}")
_WARNED: set[str] = set()


def check(cfg, fedpa, method=None) -> None:
    """ValueError, one line naming the key, for what of FS's ``cfg`` (``fedpa``: its checked section) would act
    outside the DP mechanism; a warning for what reads training data in evaluation only (``method``: the run's
    :class:`~fs_fedpa.methods.base.FederatedMethod` class, whose ``instance_mix`` it reads)."""
    kind = registry.entry(fedpa.dp.mode)
    if not kind.noised:
        return
    under = f"with differential privacy (fedpa.dp.mode {fedpa.dp.mode})"
    splits = [str(s) for s in cfg.eval.split]
    if "train" in splits:
        raise ValueError(
            f"eval.split {splits} {under}: each client would send the server metrics of its training records, "
            "outside the mechanism; leave 'train' out of eval.split"
        )
    if cfg.early_stop.patience > 0:
        raise ValueError(
            f"early_stop.patience(={cfg.early_stop.patience}) {under}: FS's early stop ends the run on the clients' "
            f"evaluation metrics ({cfg.eval.best_res_update_round_wise_key}), which are outside the mechanism, so "
            "the rounds released would depend on data the guarantee does not cover; set early_stop.patience 0 "
            "(FS's default is 5)"
        )
    if cfg.federate.make_global_eval or cfg.federate.merge_test_data:
        key = "federate.merge_test_data" if cfg.federate.merge_test_data else "federate.make_global_eval"
        raise ValueError(
            f"{key} {under}: FS's server would evaluate on its own copy of the data, in a standalone run every "
            "client's splits merged (training records included), outside the mechanism; leave it False (each client "
            "evaluates its own splits)"
        )
    _check_pld_steps(cfg, fedpa, kind)
    if kind.per_example and getattr(method, "instance_mix", None) is not None:
        _warn_instance_mix(method.name, fedpa)


def _check_pld_steps(cfg, fedpa, kind) -> None:
    """The PLD accountant's events a client (sample mode, steps counted in batches) or the server (client mode)
    composes, refused above its bound before any data is read (epochs: known only from the data, checked then)."""
    if fedpa.dp.accountant != "pld":
        return
    from fs_fedpa.privacy.accountant import check_pld_events

    rounds = max(int(fedpa.dp.horizon), int(cfg.federate.total_round_num))
    if not kind.per_example:
        check_pld_events(rounds)
    elif str(cfg.train.batch_or_epoch) == "batch":
        check_pld_events(rounds * int(cfg.train.local_update_steps))


def _warn_instance_mix(name: str, fedpa) -> None:
    message = (
        f"federate.method {name} under DP-SGD (fedpa.dp.mode {fedpa.dp.mode}): its paper-protocol evaluation weighs "
        "each test input by its similarity to some of the client's raw training inputs, and so does an export's "
        "instance mix given training inputs; those scores and predictions are OUTSIDE the guarantee (the trained "
        "adapters and the local protocol's scores are inside; docs/dev/faults.md, Options and values)"
    )
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
