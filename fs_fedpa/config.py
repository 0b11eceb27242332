"""The ``fedpa:`` section: one validated dataclass, from which the FS node, its check and the docs derive.

No FederatedScope and no torch here: ``fs_fedpa.plugin.config_fs`` turns :class:`FedPAConfig` into an FS
``CN`` node, and ``docs/config.md`` is checked against :func:`describe` by the tests. The keys of the method
(lambda, ranks, reconstruction, schedule) sit at the top of the section; each other concern is a part of its own
(``fedpa.net``, ``fedpa.store``, ``fedpa.export``, ``fedpa.eval``, ``fedpa.records``:
:mod:`fs_fedpa.config_sections`; ``fedpa.dp``: :class:`~fs_fedpa.privacy.settings.DPSettings`), and a method's own
options are declared in its file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from fs_fedpa.config_sections import (
    EvalConfig,
    ExportConfig,
    NetConfig,
    RecordsConfig,
    StoreConfig,
    build,
    is_part,
    part,
)
from fs_fedpa.config_sections import describe as _describe
from fs_fedpa.core.schedule import SCHEDULES  # torch-free
from fs_fedpa.privacy.settings import SEED_MAX, DPSettings
from fs_fedpa.quantization import CHOICES as QUANTIZATION_CHOICES
from fs_fedpa.tracking import KINDS as TRACKERS  # no backend imported
from fs_fedpa.values import int_list as _int_list
from fs_fedpa.values import integer as _integer
from fs_fedpa.values import number as _number

REG_CHOICES = ("product", "b", "a", "both", "none")
SVD_CHOICES = ("reduced", "randomized", "dense")
ADAPTIVE_CHOICES = ("none", "loss", "grad", "direction")
LAM_MAX = 1e6  # upper bound of fedpa.lam and fedpa.lam_max: far above any useful weight, far below an overflow


@dataclass
class FedPAConfig:
    """FedPA-LoRA options (the ``fedpa:`` section of an FS yaml)."""

    lam: float = field(
        default=1.0,
        metadata={
            "help": (
                "lambda: weight of the alignment term lam/2 * ||B_i A_i - B_g,i A_g,i||_F^2 (0 to 1e6); "
                "lambda_0 of the adaptive rules"
            )
        },
    )
    reg: Literal["product", "b", "a", "both", "none"] = field(
        default="product",
        metadata={
            "help": (
                "alignment term: 'product' (FedPA-LoRA), factor-wise ablations 'b', 'a', 'both' (need R_i "
                "== r_i), or 'none'"
            )
        },
    )
    svd: Literal["reduced", "randomized", "dense"] = field(
        default="reduced",
        metadata={
            "help": (
                "server reconstruction: 'reduced' (exact: float64 Gram route, or QR + core SVD for float64 "
                "uploads), 'randomized' (sketch of width R_g + oversample), 'dense' (forms the d x k aggregate; "
                "comparison only)"
            )
        },
    )
    oversample: int = field(
        default=8, metadata={"help": "p, sketch oversampling of svd: randomized (>= 0; the Halko bound needs >= 2)"}
    )
    client_ranks: list[int] = field(
        default_factory=list,
        metadata={
            "help": (
                "r_i per client, or one rank per group with group_sizes; empty: every client uses llm.adapter.args r"
            )
        },
    )
    reference_ranks: list[int] = field(
        default_factory=list,
        metadata={"help": "R_i per client, or one per group with group_sizes; empty: R_g for everyone"},
    )
    group_sizes: list[int] = field(
        default_factory=list,
        metadata={
            "help": (
                "sizes of contiguous client groups (sum = client_num) for group-wise client_ranks / "
                "reference_ranks, e.g. [7, 7, 6] with client_ranks [2, 4, 16]"
            )
        },
    )
    adaptive_lam: Literal["none", "loss", "grad", "direction"] = field(
        default="none",
        metadata={
            "help": (
                "adaptive lambda rule of Appendix F: 'loss' (F.1), 'grad' (F.2), 'direction' (F.3), or "
                "'none' (fixed lam)"
            )
        },
    )
    adaptive_alpha: float = field(default=1.0, metadata={"help": "alpha of the 'loss' and 'grad' rules (>= 0)"})
    lam_min: float = field(default=0.0, metadata={"help": "lower clip of the 'grad' rule (>= 0)"})
    lam_max: float = field(default=10.0, metadata={"help": "upper clip of the 'grad' rule (> lam_min, <= 1e6)"})
    max_weight_ratio: float = field(
        default=0.0,
        metadata={
            "help": (
                "bounded influence (opt-in): cap every client's aggregation weight at this multiple of the round's "
                "median weight (>= 1); 0: off, FS's weights as they are (the paper)"
            )
        },
    )
    max_failed_rounds: int = field(
        default=3,
        metadata={
            "help": (
                "stop the run (non-zero exit, with the reasons) after this many rounds in a row in which every "
                "upload was dropped; 0: never stop"
            )
        },
    )
    norm_outlier: float = field(
        default=0.0,
        metadata={
            "help": (
                "bounded influence (opt-in): drop an upload whose ||Delta W_i||_F exceeds this multiple of the "
                "round's median over at least 3 uploads (> 1); 0: off (the paper)"
            )
        },
    )
    dp: DPSettings = part(DPSettings, "differential privacy (docs/privacy.md)")
    net: NetConfig = part(NetConfig, "distributed mode: the server's and the clients' waits, and message signing")
    store: StoreConfig = part(StoreConfig, "the clients' kept state in memory and the run's checkpoint")
    export: ExportConfig = part(ExportConfig, "the trained adapters as PEFT directories")
    eval: EvalConfig = part(EvalConfig, "what an evaluation scores besides the paper protocol")
    records: RecordsConfig = part(RecordsConfig, "the study files a run writes into its folder")
    # fedpa.<method>.*: each method's own options, declared in its file (FederatedMethod.options) and built by the
    # plugin's config node; {} here, so this module stays torch-free
    methods: dict[str, Any] = field(default_factory=dict)
    max_clients: int = field(
        default=10_000,
        metadata={"help": "federate.client_num above it is refused (FS sets clients up at about 0.6 s each); raise "
                          "it to opt in"},
    )
    num_threads: int = field(
        default=0,
        metadata={
            "help": (
                "torch threads of a standalone simulation; 0 keeps FederatedScope's choice "
                "(its standalone runner pins 1 thread)"
            )
        },
    )
    base_quantization: Literal["none", "int8", "nf4"] = field(
        default="none",
        metadata={
            "help": (
                "load the frozen base of a '@seqcls_llm' or '@huggingface_llm' model in 8 bits (int8: LLM.int8) or "
                "4 bits (nf4: NF4) with bitsandbytes (the quant extra); LoRA factors and heads stay float32. Refused "
                "with the methods that write the base weights: fedex_lora, flora, fed_plora, feddpa_t, feddpa_f "
                "(docs/dev/plugin.md)"
            )
        },
    )
    lr_schedule: Literal["none", "constant", "cosine"] = field(
        default="none",
        metadata={
            "help": (
                "one learning-rate schedule over the whole run, by the global step t * tau + k (FS's own schedulers "
                "restart every round): 'constant' or 'cosine' after lr_warmup_steps of linear warm-up; 'none' leaves "
                "train.optimizer.lr (and FS's train.scheduler) as they are"
            )
        },
    )
    lr_warmup_steps: int = field(
        default=0,
        metadata={"help": "global steps of linear warm-up from lr / warmup to lr (with lr_schedule)"},
    )
    keep_moments: bool = field(
        default=False,
        metadata={"help": "keep each client's optimizer state (AdamW moments, step) across rounds, by parameter "
                          "name; for methods keeping their own factors; refused with a personal phase"},
    )
    track: Literal["none", "tensorboard", "wandb", "mlflow"] = field(
        default="none",
        metadata={"help": "the tracker the server feeds every round, in <outdir>/tracking (the track extra): "
                          "'tensorboard', 'wandb', 'mlflow' or 'none' (docs/observability.md)"},
    )
    seed: int = field(
        default=-1,
        metadata={
            "help": (
                "seed of the global initialisation and the randomized sketch (0 to 2**32 - 1, the range of FS's "
                "top-level seed); -1: use the top-level seed"
            )
        },
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            if is_part(f) and isinstance(getattr(self, f.name), Mapping):  # a nested dict, as a yaml gives it
                setattr(self, f.name, build(f.default_factory, getattr(self, f.name)))
        self.lam = _number(self.lam, "lam", minimum=0.0)
        if self.lam > LAM_MAX:
            raise ValueError(
                f"fedpa.lam(={self.lam:g}) must be <= {LAM_MAX:g}: a larger weight swamps the task loss and soon "
                "overflows the alignment term, so every upload would be dropped"
            )
        if self.reg not in REG_CHOICES:
            raise ValueError(f"fedpa.reg(={self.reg!r}) must be one of {REG_CHOICES}")
        if self.svd not in SVD_CHOICES:
            raise ValueError(f"fedpa.svd(={self.svd!r}) must be one of {SVD_CHOICES}")
        self.oversample = _integer(self.oversample, "oversample", minimum=0)
        self.client_ranks = _int_list(self.client_ranks, "client_ranks")
        self.reference_ranks = _int_list(self.reference_ranks, "reference_ranks")
        self.group_sizes = _int_list(self.group_sizes, "group_sizes")
        if self.adaptive_lam not in ADAPTIVE_CHOICES:
            raise ValueError(f"fedpa.adaptive_lam(={self.adaptive_lam!r}) must be one of {ADAPTIVE_CHOICES}")
        self.adaptive_alpha = _number(self.adaptive_alpha, "adaptive_alpha", minimum=0.0)
        self.lam_min = _number(self.lam_min, "lam_min", minimum=0.0)
        self.lam_max = _number(self.lam_max, "lam_max", minimum=0.0)
        if self.lam_max > LAM_MAX:  # the 'grad' rule's lambda reaches its clip
            raise ValueError(f"fedpa.lam_max(={self.lam_max:g}) must be <= {LAM_MAX:g}, the bound of fedpa.lam")
        if not self.lam_max > self.lam_min:
            raise ValueError(f"fedpa.lam_max(={self.lam_max}) must be > fedpa.lam_min(={self.lam_min})")
        self.max_weight_ratio = _number(self.max_weight_ratio, "max_weight_ratio", minimum=0.0)
        if 0 < self.max_weight_ratio < 1:
            raise ValueError(f"fedpa.max_weight_ratio(={self.max_weight_ratio}) must be 0 (off) or >= 1")
        self.max_failed_rounds = _integer(self.max_failed_rounds, "max_failed_rounds", minimum=0)
        self.norm_outlier = _number(self.norm_outlier, "norm_outlier", minimum=0.0)
        if 0 < self.norm_outlier <= 1:
            raise ValueError(f"fedpa.norm_outlier(={self.norm_outlier}) must be 0 (off) or > 1")
        self.num_threads = _integer(self.num_threads, "num_threads", minimum=0)
        if not isinstance(self.keep_moments, bool):
            raise ValueError(f"fedpa.keep_moments must be True or False, got {self.keep_moments!r}")
        self.max_clients = _integer(self.max_clients, "max_clients", minimum=1)
        if self.base_quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"fedpa.base_quantization(={self.base_quantization!r}) must be one of {QUANTIZATION_CHOICES}"
            )
        cpus = os.cpu_count() or 1
        if self.num_threads > cpus:
            raise ValueError(f"fedpa.num_threads(={self.num_threads}) > the {cpus} CPUs of this machine")
        if self.group_sizes and not (self.client_ranks or self.reference_ranks):
            raise ValueError(
                f"fedpa.group_sizes {self.group_sizes} is set but neither fedpa.client_ranks nor "
                f"fedpa.reference_ranks is: give one rank per group, or drop group_sizes"
            )
        self.seed = _integer(self.seed, "seed", minimum=-1)
        if self.seed > SEED_MAX:
            raise ValueError(
                f"fedpa.seed(={self.seed}) must be <= 2**32 - 1 (= {SEED_MAX}), the range of FS's top-level seed "
                "(torch's generators overflow beyond 2**64 - 1)"
            )
        if self.track not in TRACKERS:
            raise ValueError(f"fedpa.track(={self.track!r}) must be one of {TRACKERS}")
        self.dp.check_with(self)  # fs_fedpa.privacy.settings: what DP refuses of the section's other keys
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"fedpa.lr_schedule(={self.lr_schedule!r}) must be one of {SCHEDULES}")
        self.lr_warmup_steps = _integer(self.lr_warmup_steps, "lr_warmup_steps", minimum=0)
        if self.lr_warmup_steps and self.lr_schedule == "none":
            raise ValueError(
                f"fedpa.lr_warmup_steps(={self.lr_warmup_steps}) needs fedpa.lr_schedule 'constant' or 'cosine'"
            )
        if self.adaptive_lam != "none" and self.reg != "product":
            raise ValueError(
                f"fedpa.adaptive_lam(={self.adaptive_lam!r}) adapts the product penalty; it needs fedpa.reg "
                f"'product', got {self.reg!r}"
            )

    def per_client(self, which: str, num_clients: int, values: list[int] | None = None) -> list[int]:
        """Expand ``client_ranks``/``reference_ranks`` (or ``values``, the per-client list of the key ``which``, e.g.
        a method's ``ravan.heads``) to one value per client, by ``group_sizes`` where set ([] if unset)."""
        from fs_fedpa.core.ranks import expand_groups  # torch-free caller paths never reach this

        values = getattr(self, which) if values is None else values
        if not values:
            return []
        if len(values) == num_clients and not self.group_sizes:
            return list(values)
        if self.group_sizes:
            if len(values) != len(self.group_sizes):
                raise ValueError(
                    f"fedpa.{which} has {len(values)} values but fedpa.group_sizes names {len(self.group_sizes)} "
                    f"groups"
                )
            if sum(self.group_sizes) != num_clients:
                raise ValueError(
                    f"fedpa.group_sizes {self.group_sizes} sum to {sum(self.group_sizes)}, not "
                    f"federate.client_num(={num_clients})"
                )
            return expand_groups(values, num_clients, sizes=self.group_sizes)
        raise ValueError(
            f"fedpa.{which} has {len(values)} values for federate.client_num(={num_clients}) clients; give one "
            f"per client, or one per group with fedpa.group_sizes"
        )

    def check_clients(self, num_clients: int, adapter_rank: int | None = None) -> None:
        """Cross-checks that need the federation size: lengths, R_i <= R_g, factor-wise regs need R_i == r_i."""
        r = self.per_client("client_ranks", num_clients) or ([adapter_rank] * num_clients if adapter_rank else [])
        R = self.per_client("reference_ranks", num_clients)
        if self.reg in ("b", "a", "both") and r and R and any(ri != Ri for ri, Ri in zip(r, R)):
            raise ValueError(
                f"fedpa.reg {self.reg!r} compares factors, so it needs reference_ranks == client_ranks; got "
                f"r_i={r}, R_i={R}"
            )
        if self.reg in ("b", "a", "both") and r and not R and len(set(r)) > 1:
            raise ValueError(
                f"fedpa.reg {self.reg!r} compares factors, so it needs R_i == r_i; with heterogeneous "
                f"client_ranks {r} set reference_ranks equal to them"
            )


def describe() -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every key of the section but the methods' own, in declaration order."""
    return _describe(FedPAConfig)
