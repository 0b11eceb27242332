"""Federated LoRA methods, one module each, behind :class:`fs_fedpa.methods.base.FederatedMethod`.

A method's module name is its registry key and its ``federate.method`` value, so the list of methods is read from
the package's files (:func:`names`, :mod:`fs_fedpa.methods.catalog`) without importing torch; the classes load on
first use. Torch and ``fs_fedpa.core`` only: the FS workers in ``fs_fedpa.plugin`` delegate every decision here.
"""

from __future__ import annotations

from fs_fedpa.methods.catalog import names

__all__ = ["METHODS", "FederatedMethod", "get_method", "names"]


def __getattr__(name: str):
    if name in ("METHODS", "FederatedMethod", "get_method"):
        from fs_fedpa.methods import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
