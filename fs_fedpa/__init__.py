"""fs_fedpa: FedPA-LoRA (product-space federated LoRA) as a FederatedScope-LLM plugin.

``import fs_fedpa`` is deliberately light: it imports neither torch, transformers nor
FederatedScope (the plugin's start-up hook imports it in every interpreter). The public
names below resolve lazily on first access (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "reconstruct": "fs_fedpa.core.reconstruct",
    "reconstruct_adapter": "fs_fedpa.core.reconstruct",
    "product_penalty": "fs_fedpa.core.penalty",
    "factor_penalty": "fs_fedpa.core.penalty",
    "regularizer": "fs_fedpa.core.penalty",
    "RankPlan": "fs_fedpa.core.ranks",
    "init_global_factors": "fs_fedpa.core.ranks",
    "truncate_factors": "fs_fedpa.core.ranks",
    "expand_groups": "fs_fedpa.core.ranks",
    "aggregation_error": "fs_fedpa.core.diagnostics",
    "initialization_error": "fs_fedpa.core.diagnostics",
    "aggregate_spectrum": "fs_fedpa.core.diagnostics",
    "factored_norm": "fs_fedpa.core.norms",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fs_fedpa' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
