"""The ``fedpa:`` section's nested parts, one dataclass per concern, and the walk over them that the FS node, the
docs table, FS's ``--help`` and the flat-key mapping all derive from. No FederatedScope and no torch here.

A part is a dataclass whose fields carry ``help`` (and, for a key that used to sit flat in ``fedpa:``, ``was``: its
old name) in their metadata; :class:`~fs_fedpa.config.FedPAConfig` holds the parts as fields made by
:func:`part`. A method's own options are such a dataclass too, declared in the method's file
(:attr:`fs_fedpa.methods.base.FederatedMethod.options`), under ``fedpa.<method>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from fs_fedpa.values import integer, number


def key(default: Any, help: str, *, was: str = "") -> Any:
    """A field of a part: its default, its help and (``was``) the flat ``fedpa.<was>`` key it replaces."""
    meta = {"help": help, "was": was}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def part(cls: type, help: str) -> Any:
    """A field of :class:`~fs_fedpa.config.FedPAConfig` holding the part ``cls`` (``fedpa.<field name>.*``)."""
    return field(default_factory=cls, metadata={"help": help, "part": True})


def is_part(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("part"))


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def walk(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """``(dotted key, field)`` for every key of ``cls`` and of its parts, in declaration order."""
    for f in fields(cls):
        if is_part(f):
            yield from walk(f.default_factory, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif "help" in f.metadata:
            yield f"{prefix}{f.name}", f


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, default, help)`` of every key of ``cls``: the source of docs/config.md and of FS's --help."""
    return [(name, repr(_default(f)), f.metadata["help"]) for name, f in walk(cls, prefix)]


def flat_names(cls: type, prefix: str = "") -> dict[str, str]:
    """``{old flat name: dotted key}`` of the keys of ``cls`` that moved into a part (their ``was``)."""
    return {f.metadata["was"]: name for name, f in walk(cls, prefix) if f.metadata.get("was")}


def build(cls: type, values: Mapping[str, Any]):
    """An instance of ``cls`` from a nested mapping (an FS ``CN`` node), each part built from its own node; tuples
    (which yacs may hand back after ``merge_from_list``) become lists."""
    kwargs = {}
    for f in fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        if is_part(f):
            kwargs[f.name] = build(f.default_factory, value)  # type: ignore[arg-type]
        elif "help" in f.metadata:
            kwargs[f.name] = list(value) if isinstance(value, tuple) else value
    return cls(**kwargs)


def changed(obj: Any, prefix: str = "") -> list[str]:
    """The dotted keys of ``obj`` (a config dataclass) whose values differ from their defaults."""
    out = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_part(f):
            out += changed(value, f"{prefix}{f.name}.")
        elif "help" in f.metadata and value != _default(f):
            out.append(f"{prefix}{f.name}")
    return out


def _flag(obj: Any, name: str, where: str) -> None:
    if not isinstance(getattr(obj, name), bool):
        raise ValueError(f"fedpa.{where}.{name} must be True or False, got {getattr(obj, name)!r}")


def _path(obj: Any, name: str, where: str) -> None:
    if not isinstance(getattr(obj, name), str):
        raise ValueError(f"fedpa.{where}.{name} must be a file path (a string), got {getattr(obj, name)!r}")


@dataclass
class NetConfig:
    """``fedpa.net``: distributed mode's waits, the signing of its messages and its mutual TLS."""

    round_timeout_s: float = key(
        3600.0,
        "distributed mode: seconds the server waits for the updates (or evaluations) of a round; after it, it goes on "
        "with what arrived if at least min_received updates did, else it stops the run with the reason and tells the "
        "clients to finish; 0: wait forever (FS's behaviour)",
        was="round_timeout_s",
    )
    min_received: int = key(
        1,
        "distributed mode: the fewest updates a round may aggregate after round_timeout_s (>= 1)",
        was="min_received",
    )
    join_timeout_s: float = key(
        3600.0,
        "distributed mode: seconds the server waits for the next client to join; after it, it stops the run non-zero "
        "naming the clients that never joined (a join it refused, e.g. with a wrong key, does not count) and tells "
        "those that joined to finish; 0: wait forever (FS's behaviour)",
        was="join_timeout_s",
    )
    client_timeout_s: float = key(
        9000.0,
        "distributed mode: seconds a client waits for a message from the server before it exits non-zero with the "
        "reason (0: wait forever); keep it above round_timeout_s plus the longest aggregation, since an honest client "
        "may wait through a round that waits out a dead peer",
        was="client_timeout_s",
    )
    auth_keyring: str = key(
        "",
        "distributed mode, server: file of '<client id> <hex key>' lines, one per client; every message from a client "
        "must then be signed with its key (HMAC-SHA256), and a joining client gets the id of its key; empty: no "
        "authentication (docs/distributed.md)",
        was="auth_keyring",
    )
    auth_key: str = key(
        "",
        "distributed mode, client: file holding this client's key (64+ hex digits, never sent); the client signs its "
        "join and every message to the server with it",
        was="auth_key",
    )
    tls_cert: str = key(
        "",
        "distributed mode: this party's certificate (PEM), signed by tls_ca, naming fedpa-server or "
        "fedpa-client-<id>; with tls_key and tls_ca, every connection is mutual TLS (docs/distributed.md)",
    )
    tls_key: str = key("", "distributed mode: the private key (PEM) of tls_cert")
    tls_ca: str = key("", "distributed mode: the run's CA certificate (PEM)")

    def __post_init__(self) -> None:
        self.round_timeout_s = number(self.round_timeout_s, "net.round_timeout_s", minimum=0.0)
        self.min_received = integer(self.min_received, "net.min_received", minimum=1)
        self.join_timeout_s = number(self.join_timeout_s, "net.join_timeout_s", minimum=0.0)
        self.client_timeout_s = number(self.client_timeout_s, "net.client_timeout_s", minimum=0.0)
        if 0 < self.client_timeout_s <= self.round_timeout_s:
            raise ValueError(
                f"fedpa.net.client_timeout_s(={self.client_timeout_s:g}) must exceed fedpa.net.round_timeout_s"
                f"(={self.round_timeout_s:g}): an honest client may wait through a round that waits out a dead peer"
            )
        _path(self, "auth_keyring", "net")
        _path(self, "auth_key", "net")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            _path(self, name, "net")
        unset = [name for name in ("tls_cert", "tls_key", "tls_ca") if not getattr(self, name)]
        if 0 < len(unset) < 3:
            raise ValueError(
                f"fedpa.net.tls_cert, tls_key and tls_ca go together; {', '.join(unset)} "
                f"{'is' if len(unset) == 1 else 'are'} not set"
            )


@dataclass
class StoreConfig:
    """``fedpa.store``: where a run keeps its state, in memory and on disk."""

    state_budget_mb: float = key(
        0.0,
        "host memory (MiB) for what the clients keep between their rounds (own factors, local tensors, merges, "
        "personal adapters), off the accelerator; beyond it the least recently used clients are written to "
        "<outdir>/fedpa_state/ (safetensors) and read back when sampled. 0: no limit",
        was="state_budget_mb",
    )
    checkpoint: bool = key(
        True,
        "when federate.save_to is empty, save the run's checkpoint, resume points and client end states in the run's "
        "own folder (<outdir>/checkpoint.pt, FS's final_checkpoint.pt at the end); False saves none. An explicit "
        "federate.save_to is used as FS uses it",
        was="checkpoint",
    )

    def __post_init__(self) -> None:
        self.state_budget_mb = number(self.state_budget_mb, "store.state_budget_mb", minimum=0.0)
        _flag(self, "checkpoint", "store")


@dataclass
class ExportConfig:
    """``fedpa.export``: the trained adapters as PEFT directories at the end of the run."""

    dir: str = key(
        "",
        "at the end of the run, write the trained adapters as standard PEFT directories into this folder "
        "(docs/export.md): the server the global adapter, each client its local tensors (heads/); '' writes none. "
        "The folder must be empty or absent",
        was="export_dir",
    )
    clients: bool = key(
        False,
        "with fedpa.export.dir: each client also writes its own model (client_<id>/) as a PEFT directory",
        was="export_clients",
    )

    def __post_init__(self) -> None:
        _path(self, "dir", "export")
        _flag(self, "clients", "export")


@dataclass
class EvalConfig:
    """``fedpa.eval``: what each evaluation scores besides the paper's protocol."""

    local: bool = key(
        True,
        "also evaluate each client's own preserved factors, reported as local.<split>_<metric> beside the paper "
        "protocol's <split>_<metric>",
        was="eval_local",
    )
    refit_head: bool = key(
        False,
        "a diagnostic (sequence classification): after the last upload also score both protocols with the head "
        "refitted without DP on the client's training split, as refit.* and local.refit.*; those scores are outside "
        "any DP guarantee",
        was="eval_refit_head",
    )

    def __post_init__(self) -> None:
        _flag(self, "local", "eval")
        _flag(self, "refit_head", "eval")


DIAGNOSTICS = ("light", "full", "off")  # fedpa.records.diagnostics


@dataclass
class RecordsConfig:
    """``fedpa.records``: the study files a run writes into its folder."""

    diagnostics: str = key(
        "light",
        "light: bytes, weights, alignment, drops to <outdir>/fedpa_diagnostics.jsonl; full adds E_agg, spectra, "
        "drift, gradient split (study); off: none; True/False: full/off",
        was="diagnostics",
    )
    save_outcomes: bool = key(
        False,
        "sequence classification: write which evaluation examples each client got right, per evaluation and protocol, "
        "to <outdir>/fedpa_outcomes.jsonl, and each client's examples as indices of the GLUE evaluation file to "
        "<outdir>/fedpa_eval_shards.json (per-sentence analyses, paired bootstraps)",
        was="save_outcomes",
    )

    def __post_init__(self) -> None:
        if isinstance(self.diagnostics, bool):  # the flag this key was before it had a light level
            self.diagnostics = "full" if self.diagnostics else "off"
        if self.diagnostics not in DIAGNOSTICS:
            raise ValueError(f"fedpa.records.diagnostics must be one of {', '.join(DIAGNOSTICS)}, got "
                             f"{self.diagnostics!r}")  # fmt: skip
        _flag(self, "save_outcomes", "records")

    @property
    def full(self) -> bool:
        """Whether the study's diagnostics are computed (``diagnostics: full``)."""
        return self.diagnostics == "full"

    @property
    def written(self) -> bool:
        """Whether the round records are written to ``fedpa_diagnostics.jsonl`` (not ``off``)."""
        return self.diagnostics != "off"
