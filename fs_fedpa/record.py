"""One round's diagnostics: the record the server writes, the comparison runner reads and docs/dev/plugin.md lists.

No torch and no FederatedScope here, so the comparison runner and the docs test import it cheaply. The server
appends one :class:`RoundRecord` per round, as a JSON line, to ``<outdir>/fedpa_diagnostics.jsonl``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from fs_fedpa.values import finite_number as _number

DIAGNOSTICS_FILE = "fedpa_diagnostics.jsonl"
# fedpa.records.save_outcomes: one JSON line per client, evaluation and protocol ({"round", "client", "protocol",
# "split", "correct": "0110..."}, the examples of the client's split in the loader's order), and the clients'
# examples as indices of the GLUE evaluation file ({"size": n, "splits": {split: {client id: [index, ...]}}}).
OUTCOMES_FILE = "fedpa_outcomes.jsonl"
EVAL_SHARDS_FILE = "fedpa_eval_shards.json"
PRIVACY_FILE = "fedpa_privacy.jsonl"  # the DP ledger, one line a round (fs_fedpa.privacy.private)
# client-level DP: which client's upload the server dropped and why, server-private and outside epsilon
PRIVATE_FAULTS_FILE = "fedpa_dp_faults.jsonl"
# sample-level DP: each client's own accounting, one line a round it trains ({"round", "client", "epsilon", "delta",
# "steps", "n", "b", "z", "clip", "sampling", "accountant", "prior_sigma" (the label count's, 0: none), "nonfinite",
# "empty", "clipped_sum", "noise"}); the last two are the round's mean per step, read from its records, so the file is
# the client's and never sent
CLIENT_PRIVACY_FILE = "fedpa_client_privacy.jsonl"
# beside a client's evaluation metrics: the wall seconds the evaluation took (the server takes it out before FS merges)
EVAL_SECONDS = "fedpa.eval_seconds"

# What each client reports about its round (fs_fedpa.plugin.client); the record keeps them per client and summarised.
CLIENT_STATS = (
    "delta_norm",
    "change_norm",
    "drift",
    "drift_rel",
    "grad_ratio_first",
    "grad_ratio_last",
    "staleness",
    "drift_start",
)

# the systems fields a client reports (as ``sys_<name>``, fs_fedpa.systems.SYSTEMS_STATS), kept per client
SYSTEMS = ("train_seconds", "train_batches", "train_examples", "train_tokens", "peak_memory")
# the fields that measure time or memory: they differ between two runs of the same computation
TIMING_FIELDS = ("train_seconds", "examples_per_s", "tokens_per_s", "peak_memory", "aggregate_seconds",
                 "server_peak_memory", "wall_seconds")  # fmt: skip


def _f(help: str, default: Any = None, factory: Any = None):
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class RoundRecord:
    """Diagnostics of one aggregation, from factors only (no ``(d, k)`` matrix)."""

    round: int = _f("FS round index")
    method: str = _f("federate.method")
    svd: str = _f("fedpa.svd of the run")
    R_g: int = _f("rank of the global adapter")
    clients: list = _f("FS ids of the clients aggregated", factory=list)
    weights: list = _f("their aggregation weights w_i, in that order", factory=list)
    e_agg: float = _f(
        "E_agg = ||B_g A_g - sum_i w_i Delta W_i||_F over all LoRA modules (root of the sum of squares)", 0.0
    )
    e_agg_rel: float = _f("E_agg relative to ||sum_i w_i Delta W_i||_F", 0.0)
    global_update_norm: float = _f(
        "||sum_i w_i Delta W_i||_F over all LoRA modules: the update the clients agree on", 0.0
    )
    global_norm: float = _f("||B_g A_g||_F over all LoRA modules: the global adapter the server installs", 0.0)
    probe_module: str = _f("the first LoRA module, on which the per-module fields are measured", "")
    e_agg_probe: float = _f("E_agg of the probe module", 0.0)
    spectrum_probe: list = _f(
        "singular values of the probe module's aggregate (methods that compute them)", factory=list
    )
    alignment_loss: dict = _f(
        "per client: lam/2 * its alignment term at the end of its round's training", factory=dict
    )
    alignment_loss_mean: float = _f("mean of alignment_loss over clients", 0.0)
    lam: dict = _f(
        "per client: the lambda used (the common lambda, or lambda_i^(t) of an adaptive rule)", factory=dict
    )
    e_init_B: dict = _f(
        "per client: relative jump of B at the start of the round, E_init (§3.3), probe module", factory=dict
    )
    e_init_A: dict = _f("per client: the same for A; 0 for FedPA-LoRA", factory=dict)
    delta_norm: dict = _f("per client: ||Delta W_i||_F = ||s_i B_i A_i||_F over all LoRA modules", factory=dict)
    change_norm: dict = _f(
        "per client: the Frobenius norm, over all modules, of the change of the factors it uploads from those it "
        "started the round from (what client-level DP clips for the factor methods)",
        factory=dict,
    )
    drift: dict = _f(
        "per client: ||Delta W_i - X_g,i||_F from the reference X_g,i it received this round, all modules",
        factory=dict,
    )
    drift_rel: dict = _f("per client: drift / ||X_g,i||_F (absent while the reference is 0)", factory=dict)
    grad_ratio_first: dict = _f(
        "per client: ||grad of the alignment term|| / ||grad of the task loss|| on its factors, first step",
        factory=dict,
    )
    grad_ratio_last: dict = _f("per client: the same at the round's last step", factory=dict)
    staleness: dict = _f("per client that trained before: rounds since its last training round", factory=dict)
    drift_start: dict = _f(
        "per client that trained before: ||s_i B_i A_i - X_g,i||_F at the round's start, its preserved product "
        "against the reference it received, all modules (does a factor that sat out drift from the reference?)",
        factory=dict,
    )
    spread: dict = _f(
        "per client field of CLIENT_STATS: [mean, std, min, max] over the clients that report it", factory=dict
    )
    upload_ranks: dict = _f("per client: the ranks of its uploaded factors", factory=dict)
    dropped: dict = _f("per client whose upload was not aggregated: the reason", factory=dict)
    restarted: list = _f("clients whose own factors became non-finite and restarted from the reference", factory=list)
    nonfinite_stats: dict = _f(
        "per client: the stats it reported that are not finite (left out above; its upload is aggregated)",
        factory=dict,
    )
    bytes_up: dict = _f("per client: tensor bytes it sent this round", factory=dict)
    bytes_down: dict = _f("per client: tensor bytes it received this round", factory=dict)
    bytes_up_total: int = _f("uplink bytes of the run so far", 0)
    bytes_down_total: int = _f("downlink bytes of the run so far", 0)
    train_seconds: dict = _f("per client: wall seconds of its local training this round (absent under DP)",
                             factory=dict)
    train_batches: dict = _f("per client: the batches it trained on this round", factory=dict)
    train_examples: dict = _f("per client: the examples in those batches", factory=dict)
    train_tokens: dict = _f("per client: the tokens in those batches (attention mask), where its batches have any",
                            factory=dict)
    examples_per_s: dict = _f("per client: train_examples / train_seconds", factory=dict)
    tokens_per_s: dict = _f("per client: train_tokens / train_seconds", factory=dict)
    peak_memory: dict = _f(
        "per client: peak bytes of its training, CUDA's allocator on a GPU, else the process's resident set",
        factory=dict,
    )
    aggregate_seconds: float = _f("wall seconds of the server's aggregation (decoding and checks included)", 0.0)
    server_peak_memory: int = _f("peak bytes of the server's aggregation, of memory_kind", 0)
    memory_kind: str = _f("the server's memory measure: 'cuda' (allocator peak) or 'rss' (resident set)", "rss")
    wall_seconds: float = _f("wall seconds since the run began (a resumed run's included) at the round's end", 0.0)

    def add_client_stats(self, clients: list[int], stats: list[dict]) -> None:
        """Fill the per-client fields from the clients' uploaded ``stats`` and summarise each in :attr:`spread`. A
        stat that is not a finite number (None from the server's intake, NaN, Inf) is left out and named in
        :attr:`nonfinite_stats`."""
        for key in ("lam", "e_init_B", "e_init_A", *CLIENT_STATS):
            values = {str(c): float(s[key]) for c, s in zip(clients, stats) if _number(s.get(key))}
            setattr(self, key, values)
            if key in CLIENT_STATS and values:
                v = list(values.values())
                self.spread[key] = [statistics.mean(v), statistics.pstdev(v), min(v), max(v)]
        terms = {str(c): float(t) for c, s in zip(clients, stats) if _number(t := s.get("alignment_loss", 0.0))}
        self.alignment_loss = terms
        self.alignment_loss_mean = statistics.mean(terms.values()) if terms else 0.0
        for key in SYSTEMS:
            values = {str(c): s[f"sys_{key}"] for c, s in zip(clients, stats) if _number(s.get(f"sys_{key}"))}
            setattr(self, key, {c: int(v) if key != "train_seconds" else float(v) for c, v in values.items()})
        for rate, count in (("examples_per_s", "train_examples"), ("tokens_per_s", "train_tokens")):
            counts = getattr(self, count)
            setattr(self, rate, {c: counts[c] / s for c, s in self.train_seconds.items() if c in counts and s > 0})
        self.nonfinite_stats = {
            str(c): bad for c, s in zip(clients, stats) if (bad := sorted(k for k, v in s.items() if not _number(v)))
        }

    def not_finite(self) -> list[str]:
        """The fields that hold a NaN or an Inf (a diagnostic that overflowed); :meth:`to_dict` writes them as None."""
        return [f.name for f in fields(self) if finite(getattr(self, f.name)) != getattr(self, f.name)]

    def to_dict(self) -> dict:
        """The record as plain data, every NaN or Inf in it as None: null in the JSON file, which stays standard
        JSON (``Infinity`` is not), and a diagnostic's overflow is recorded, not raised."""
        return finite(asdict(self))


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite, however deep in dicts and lists, replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def compact(record: dict) -> dict:
    """What the comparison keeps of a record: its scalar fields, each client field's mean over clients
    (``<field>_mean``; E_init's as ``e_init_B``/``e_init_A``), the clients' λ as ``lam_mean``, ``lam_min`` and
    ``lam_max`` (an adaptive rule's λ_i^(t) differ per client), the probe's spectrum, the bytes so far and, under
    partial participation, each returning client's ``[staleness, drift_start]`` (``stale_drift``: does a preserved
    factor that sat out drift further from the reference?)."""
    out = {k: v for k, v in record.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    lams = [v for v in record.get("lam", {}).values() if _number(v)]
    if lams:
        out.update(lam_mean=statistics.mean(lams), lam_min=min(lams), lam_max=max(lams))
    for key in ("e_init_B", "e_init_A"):
        values = [v for v in record.get(key, {}).values() if _number(v)]
        out[key] = statistics.mean(values) if values else None
    for key, (mean, *_) in record.get("spread", {}).items():
        out[f"{key}_mean"] = mean
    out["spectrum_probe"] = record.get("spectrum_probe", [])
    stale, start = record.get("staleness", {}), record.get("drift_start", {})
    if pairs := [[stale[c], start[c]] for c in sorted(stale, key=int) if _number(stale[c]) and _number(start.get(c))]:
        out["stale_drift"] = pairs
    out["bytes_total"] = record.get("bytes_up_total", 0) + record.get("bytes_down_total", 0)
    for key in ("train_seconds", "examples_per_s", "tokens_per_s"):
        if values := [v for v in (record.get(key) or {}).values() if _number(v)]:
            out[f"{key}_mean"] = statistics.mean(values)
    if peaks := [v for v in (record.get("peak_memory") or {}).values() if _number(v)]:
        out["peak_memory_max"] = max(peaks)
    return out


def without_timings(record: dict) -> dict:
    """``record`` without :data:`TIMING_FIELDS`: what two runs of the same computation agree on."""
    return {k: v for k, v in record.items() if k not in TIMING_FIELDS}


def describe() -> list[tuple[str, str]]:
    """``(field, meaning)`` of every record field, in order: the source of docs/dev/plugin.md's table."""
    return [(f.name, f.metadata["help"]) for f in fields(RoundRecord)]

