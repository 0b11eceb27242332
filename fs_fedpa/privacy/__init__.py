"""Differential privacy (docs/privacy.md): the mechanisms, their accounting and the policies the FS workers ask.

``fedpa.dp.mode`` picks one mechanism from :mod:`~fs_fedpa.privacy.registry` once; the server and each client then
hold its policy (:func:`server_policy`, :func:`client_policy`; never None: without DP they let everything through)
and ask it what to do, never which mode runs. The package holds, with no FederatedScope import:

- :mod:`~fs_fedpa.privacy.settings`: the ``fedpa.dp_*`` keys (one dataclass) and their check;
- :mod:`~fs_fedpa.privacy.registry`: the mechanisms, declared without importing them;
- :mod:`~fs_fedpa.privacy.policy`: the interface (:class:`~fs_fedpa.privacy.policy.Mechanism`, a server and a client
  policy) and the mechanism without DP;
- :mod:`~fs_fedpa.privacy.client_level`, :mod:`~fs_fedpa.privacy.sample_level`: the two Gaussian mechanisms, on
  :mod:`~fs_fedpa.privacy.private` (the ledger, the DP generator, resume);
- :mod:`~fs_fedpa.privacy.post_processing`: client-level DP's new global factors from a release;
- :mod:`~fs_fedpa.privacy.mechanism` (clipping, noise, sampling), :mod:`~fs_fedpa.privacy.accountant`
  (dp-accounting), :mod:`~fs_fedpa.privacy.per_example` (per-example gradients).

DP-SGD's hooks into FS's trainer are FS glue, :mod:`fs_fedpa.plugin.dp_sgd`; the client passes them in. A new
mechanism is a module here and a :func:`~fs_fedpa.privacy.registry.register` call.
"""

from __future__ import annotations

from pathlib import Path

from fs_fedpa.privacy.registry import Entry, entry, modes, register

__all__ = ["Entry", "entry", "modes", "register", "mechanism_of", "server_policy", "client_policy", "check_run",
           "accounting_settings", "export_info", "trains_per_example"]  # fmt: skip


def mechanism_of(fedpa):
    """The :class:`~fs_fedpa.privacy.policy.Mechanism` of a ``fedpa`` section (its ``dp_mode``)."""
    return entry(fedpa.dp.mode).load()


def server_policy(cfg, method, **kwargs):
    """The server's :class:`~fs_fedpa.privacy.policy.ServerPolicy` for FS's ``cfg`` (keywords: its constructor's)."""
    return mechanism_of(method.cfg).Server(cfg, method, **kwargs)


def client_policy(cfg, method, trainer, local_names: list[str], dp_sgd=None):
    """A client's :class:`~fs_fedpa.privacy.policy.ClientPolicy`; ``dp_sgd``: the plugin's DP-SGD hooks."""
    return mechanism_of(method.cfg).Client(cfg, method, trainer, local_names, dp_sgd)


def check_run(cfg, fedpa) -> None:
    """What the run's mechanism refuses of FS's ``cfg`` (``fedpa``: its checked section)."""
    mechanism_of(fedpa).check_run(cfg, fedpa)


def accounting_settings(cfg) -> dict:
    """The settings a resume must keep equal for the accounting of the rounds already released."""
    return mechanism_of(cfg.fedpa).accounting_settings(cfg)


def export_info(fedpa, outdir: Path) -> dict:
    """What of an export in the run folder ``outdir`` the guarantee covers (the manifest's ``privacy``)."""
    return mechanism_of(fedpa).export_info(fedpa, Path(outdir))


def trains_per_example(fedpa) -> bool:
    """Whether the mechanism of a ``fedpa`` section trains by DP-SGD (its own chunked forward) on each client."""
    return entry(fedpa.dp.mode).per_example
