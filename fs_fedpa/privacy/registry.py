"""The DP mechanisms a run can choose (``fedpa.dp.mode``), declared without importing them (no torch here: the config
check reads these declarations).

An :class:`Entry` names the mechanism's class (``"module:Class"``, a :class:`~fs_fedpa.privacy.policy.Mechanism`,
imported when a run uses it) and what the torch-free config check needs to know of it. A new mechanism is one module
in this package and one :func:`register` call; nothing outside the package asks which mechanism runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

@dataclass(frozen=True)
class Entry:
    """One mechanism. ``target``: ``"module:Class"`` of its :class:`~fs_fedpa.privacy.policy.Mechanism`;
    ``population``: whose delta it bounds, "N clients" or "n_i records" (min(1e-5, 1/(10 x population)));
    ``own_keys``: the ``fedpa.dp`` keys only it reads; ``refuses``: the fedpa keys it cannot run with, each with the
    reason;
    ``per_example``: it trains by DP-SGD on each client (the task gradient a client sees is the noisy one, and the
    forward is the mechanism's); ``noised``: it clips and noises (needs dp.clip and one of z or epsilon); ``title``:
    its name in messages."""

    target: str
    population: str = "N clients"
    own_keys: tuple[str, ...] = ()
    refuses: dict[str, str] = field(default_factory=dict)
    per_example: bool = False
    noised: bool = True
    title: str = "differential privacy"

    def load(self):
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


_CLIENT_REFUSES = {
    "norm_outlier": "one client's update could drop another's, a release outside the mechanism; clipping to "
    "fedpa.dp.clip bounds every client",
    "max_weight_ratio": "every sampled client weighs 1/K there; unset it",
}

_ENTRIES: dict[str, Entry] = {
    "none": Entry("fs_fedpa.privacy.policy:NoPrivacy", noised=False, title="no differential privacy"),
    "client": Entry("fs_fedpa.privacy.client_level:ClientLevel", refuses=_CLIENT_REFUSES,
                    title="differential privacy at client level"),
    "sample": Entry("fs_fedpa.privacy.sample_level:SampleLevel", population="n_i records",
                    own_keys=("min_records", "chunk", "local_tensors", "local_clip", "label_prior"), per_example=True,
                    title="DP-SGD"),
}  # fmt: skip


def register(mode: str, entry: Entry) -> None:
    """Make ``fedpa.dp.mode <mode>`` run ``entry``'s mechanism; an existing mode is not replaced."""
    if mode in _ENTRIES and _ENTRIES[mode] != entry:
        raise ValueError(f"fedpa.dp.mode {mode!r} is already registered ({_ENTRIES[mode].target})")
    _ENTRIES[mode] = entry


def modes() -> tuple[str, ...]:
    return tuple(_ENTRIES)


def entry(mode: str) -> Entry:
    """The entry of ``mode``; ValueError naming the choices for one that is not registered."""
    if mode not in _ENTRIES:
        raise ValueError(f"fedpa.dp.mode(={mode!r}) must be one of {modes()}")
    return _ENTRIES[mode]
