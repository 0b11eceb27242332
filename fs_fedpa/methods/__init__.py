"""Federated LoRA methods, one module each, behind :class:`fs_fedpa.methods.base.FederatedMethod`.

Torch and ``fs_fedpa.core`` only: the FS workers in ``fs_fedpa.plugin`` delegate every decision here.
"""

from __future__ import annotations

from fs_fedpa.methods.base import METHODS, FederatedMethod, get_method

__all__ = ["METHODS", "FederatedMethod", "get_method"]
