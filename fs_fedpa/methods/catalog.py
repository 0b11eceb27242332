"""The list of federated methods, read from the package's files: a method's module name is its registry key and its
``federate.method`` value. Imports nothing (no torch), so configs and the comparison runner can list the methods
cheaply; :mod:`fs_fedpa.methods.base` uses it to import them all."""

from __future__ import annotations

import pkgutil
from pathlib import Path

NOT_METHODS = ("base", "catalog")  # the package's modules that are not methods


def names() -> tuple[str, ...]:
    """Every method's name (= module name = ``federate.method``), sorted; imports nothing."""
    folder = str(Path(__file__).parent)
    return tuple(sorted(m.name for m in pkgutil.iter_modules([folder]) if m.name not in NOT_METHODS))
