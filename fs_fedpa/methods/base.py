"""The small interface every federated LoRA method implements, and the registry of methods.

Every hook sees *applied* factors ``(s B, A)`` whose product is the update ``Delta W`` the model applies (owned by
:mod:`fs_fedpa.lora`), server and client alike; only :meth:`~FederatedMethod.load`, :meth:`~FederatedMethod.read`
and :meth:`~FederatedMethod.alignment` see the model's own (PEFT's raw factors, the reference in their frame).
Client-side hooks only select, truncate, rotate or compare factors, so they do not depend on the scale. A method
decides:

- server: ``init_global`` (Alg. 1 l.2), ``aggregate``, ``merge`` (what the exact-aggregation methods fold into
  the frozen base weights), ``downlink`` (what client i receives), ``upload_parts`` and ``complete_upload`` (which
  factors travel up, and what the server takes for the others);
- client: ``client_init`` (Alg. 1 l.4), ``start_round`` (the round's starting factors from what it received and
  what it kept), ``fold`` (what it adds to its frozen base weights for the round's training), ``personal_start``
  (a personal adapter trained first, in a phase of its own, never sent), ``trainable``, ``alignment`` (the extra
  local loss), ``end_round`` (what it keeps), ``before_upload`` (what it sends), ``evaluation_factors`` (what the
  paper protocol evaluates).

A method declares the optional hooks it implements in ``uses`` (:data:`OPTIONAL_HOOKS`); the workers skip the others.

A method whose state is not PEFT's factors (Ravan: per-head cores between frozen bases; ``state_is_factors``
False) keeps the same pairs per module for its own tensors and says how to turn them into factors (``expand``,
which every diagnostic and check reads), how to load and read them (``load``, ``read``) and what of them travels
(``upload_payload``, undone by ``complete_upload``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Generator, Tensor

from fs_fedpa import lora
from fs_fedpa.config import FedPAConfig
from fs_fedpa.core.ranks import RankPlan, init_global_factors, truncate_factors
from fs_fedpa.lora import Factors
from fs_fedpa.privacy import post_processing

PARTS = ("B", "A")
# hooks with a do-nothing default, which a method declares in ``uses`` when it implements them
OPTIONAL_HOOKS = ("merge", "fold", "personal_start", "alignment", "trainable", "end_round", "before_upload")
Uploads = Sequence[Factors]  # one per client, as complete_upload returned them

METHODS: dict[str, type[FederatedMethod]] = {}


class FederatedMethod:
    """Defaults shared by the methods; a method overrides what differs."""

    name: ClassVar[str] = ""
    merge_encoding: ClassVar[str] = "factors"  # how a merge travels: "factors" (its B, A) or "dense" (B A, d x k)
    personal_weight: ClassVar[float | None] = None  # a: the personal phase trains a * personal + (1 - a) * global
    # w of FedDPA's test time: evaluation_factors returns ([B_g, B_l], [A_g; A_l]) and the client weighs them per input
    # by g = w * mean cos(h(x), h(x_j)) and 1 - g (fs_fedpa.core.instance); None: no per-input weighting
    instance_mix: ClassVar[float | None] = None
    # False: the pairs a method keeps per module are its own state, applied without PEFT's scaling (Ravan's cores
    # and scales); expand() turns them into factors
    state_is_factors: ClassVar[bool] = True
    # client-level DP (fedpa.dp.mode client, docs/privacy.md): what a client's clipped contribution is. "product":
    # its applied product s_i B_i A_i; "change": the change of the factors it uploads from those it received; "":
    # refused. Declared by each method itself, never inherited: a subclass changes what the server releases.
    dp_space: ClassVar[str] = ""
    # what the method sends every client whole (Fed-PLoRA its modules, Ravan its heads), so that every reference rank
    # R_i and R_g must be r_g = max r_i (check_plan refuses other plans); "": each client gets its rank-R_i reference
    full_references: ClassVar[str] = ""
    # the optional hooks (OPTIONAL_HOOKS) this method implements: declared, never inferred. A class that overrides one
    # must declare it and one that declares it must implement it (checked when the class is defined); the workers
    # skip every undeclared hook, whose default returns its input, None or a constant
    uses: ClassVar[frozenset[str]] = frozenset()
    # the method's own keys, fedpa.<its name>.*: a dataclass in its file whose fields are made by
    # fs_fedpa.config_sections.key (help, and the flat key each replaces); a subclass reads its parent's section
    options: ClassVar[type | None] = None

    def __init__(self, cfg: FedPAConfig, plan: RankPlan, seed: int | None = None):
        self.cfg = cfg
        # this run's fedpa.<section>.* (the defaults where the config was built without them, as in unit tests)
        self.opts = (cfg.methods.get(self.options_section()) or self.options()) if self.options else None
        self.plan = plan
        self.seed = cfg.seed if seed is None else seed  # the run's seed (fedpa.seed, else FS's top-level seed)
        self.shapes: dict[str, tuple[int, int]] = {}  # set by bind()
        self.check_plan()

    @classmethod
    def options_section(cls) -> str:
        """``fedpa.<section>``: the name of the method that declared the :attr:`options` this class reads."""
        return next((c.name for c in cls.__mro__ if "options" in c.__dict__), "")

    def check_plan(self) -> None:
        """Raise ValueError if the rank plan does not suit the method (default: any plan, full references where
        :attr:`full_references` declares them)."""
        if self.full_references:
            self.require_full_references(self.full_references)

    def require_full_references(self, what: str) -> None:
        """ValueError unless R_g and every R_i are r_g = max r_i: for a method that sends every client all ``what``."""
        R = self.plan.r_g
        if self.plan.global_rank != R or any(R_i != R for R_i in self.plan.reference_ranks):
            raise ValueError(
                f"federate.method {self.name} sends every client all {what}; leave fedpa.reference_ranks unset or set "
                f"each to {R} (got {list(self.plan.reference_ranks)})"
            )

    def bind(self, shapes: dict[str, tuple[int, int]]) -> None:
        """Learn the model's LoRA modules, ``shapes[name] = (d, k)`` (every worker calls it once, before anything
        else); raise ValueError if the method cannot adapt them."""
        self.shapes = dict(shapes)

    def state_dict(self) -> dict:
        """The server's state of the method that a resume point carries (default: none; the factors and the round
        are the server's own). Plain numbers, lists and tensors only: resume points load with ``weights_only``."""
        return {}

    def check_state(self, state: dict, path: str, rnd: int) -> None:
        """ValueError naming the resume point ``path`` (of round ``rnd``) and the field ``method_state.<key>`` for a
        ``state`` this method did not write (:meth:`state_dict`); before any part of the point is loaded."""
        if state:
            raise ValueError(f"federate.restore_from {path!r}: field 'method_state' holds {sorted(state)}, which "
                             f"{self.name} does not keep")  # fmt: skip

    def load_state_dict(self, state: dict, path: str) -> None:
        """Continue from :meth:`state_dict`'s ``state``, read from the resume point ``path`` (checked by
        :meth:`check_state`)."""

    def expand(self, state: Factors) -> Factors:
        """Applied factors ``(B, A)`` whose product is the update a state of this method applies (the pairs
        :meth:`init_global`, :meth:`aggregate` and :meth:`complete_upload` return); the identity for methods whose
        state is factors."""
        return state

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "dp_space" not in cls.__dict__:
            cls.dp_space = ""
        unknown = sorted(set(cls.uses) - set(OPTIONAL_HOOKS))
        implemented = {h for h in OPTIONAL_HOOKS if getattr(cls, h) is not getattr(FederatedMethod, h)}
        if unknown or implemented != set(cls.uses):
            not_hooks = f" ({unknown} are not hooks)" if unknown else ""
            raise TypeError(f"{cls.__name__}.uses must name exactly the optional hooks it implements: it implements "
                            f"{sorted(implemented)} and declares {sorted(cls.uses)}{not_hooks}")  # fmt: skip
        if cls.name:
            if cls.name in METHODS:
                raise ValueError(f"federated method {cls.name!r} is registered twice")
            METHODS[cls.name] = cls

    # ------------------------------------------------------------------ server
    def init_global(self, shapes: dict[str, tuple[int, int]], generator: torch.Generator) -> Factors:
        """Rank-r_g global factors: B = 0, A Kaiming-uniform as PEFT (Alg. 1 l.2). ``shapes[name] = (d, k)``."""
        r_g = self.plan.r_g
        return {name: init_global_factors(d, k, r_g, generator=generator) for name, (d, k) in shapes.items()}

    def weights(self, round_samples: Sequence[float], data_sizes: Sequence[float | None]) -> list[float]:
        """Aggregation weights w_i (normalised later) from FS's sample counts of the round and the clients' training
        set sizes (None where a client did not report one); default: FS's rule, the round's sample counts.

        The server has checked both per client (finite, in [0, 1e15], training set sizes integers), so a weight
        built from them is too; a client of size 0 weighs 0, and the server weighs a round whose weights are all 0
        equally (docs/errors.md)."""
        return list(round_samples)

    def aggregate(
        self, uploads: Uploads, weights: Sequence[float], clients: Sequence[int], generator: Generator, rnd: int = 0
    ) -> tuple[Factors, dict[str, Tensor]]:
        """New global factors and, per module, the aggregate's singular values (may be empty), from the uploads of
        round ``rnd`` (as :meth:`complete_upload` returned them)."""
        raise NotImplementedError

    def dp_global(self, release: dict, global_: Factors, generator: Generator) -> tuple[Factors, dict[str, Tensor]]:
        """Client-level DP: the new global factors and spectra from the round's noisy release, by post-processing
        only (default: :func:`fs_fedpa.privacy.post_processing.global_from_release` for the method's ``dp_space``)."""
        R_g = self.plan.R_g
        return post_processing.global_from_release(self.dp_space, release, global_, R_g, self.cfg, generator)

    def merge(self, uploads: Sequence[Factors], weights: Sequence[float], global_: Factors) -> Factors | None:
        """Applied factors whose product every worker adds to its frozen base weights after this aggregation, so
        that base + ``global_`` carries ``sum_i w_i Delta W_i`` exactly (FedEx-LoRA's residual, FLoRA's stack);
        ``global_`` is what :meth:`aggregate` returned. None (default): nothing is merged."""
        return None

    @property
    def merges(self) -> bool:
        """Whether this method folds updates into the base weights (declares :meth:`merge`)."""
        return "merge" in self.uses

    def downlink(self, global_: Factors, client: int) -> Factors:
        """What the server sends client ``client`` (0-based index): the rank-R_i reference (Alg. 1 l.8); ``{}``
        sends none, and the client takes a zero reference at its rank r_i."""
        return {n: truncate_factors(B, A, self.plan.reference_ranks[client]) for n, (B, A) in global_.items()}

    def upload_ranks(self, client: int) -> tuple[int, ...]:
        """The ranks the server accepts in an upload of client ``client``: its r_i."""
        return (self.plan.client_ranks[client],)

    def upload_parts(self, rnd: int) -> tuple[str, ...]:
        """Which factors a client sends in round ``rnd``: ``("B", "A")``, or one of them."""
        return PARTS

    def upload_payload(self, sent: Factors, client: int, rnd: int) -> dict[str, dict[str, Tensor]]:
        """``module -> {part: tensor}``: what of the applied pairs ``sent`` travels (default: the
        :meth:`upload_parts` of the round); :meth:`complete_upload` is its inverse on the server."""
        parts = self.upload_parts(rnd)
        return {n: {p: t for p, t in zip(PARTS, pair) if p in parts} for n, pair in sent.items()}

    def complete_upload(
        self, upload: dict[str, dict[str, Tensor]], global_: Factors, client: int, rnd: int = 0
    ) -> Factors:
        """Full ``(B_i, A_i)`` from an upload of :meth:`upload_parts` only: a factor that was not sent is the one the
        client received, unchanged (the global one at the client's rank r_i). Raises ValueError for an upload the
        method cannot take (the server drops it with the message)."""
        r_i = self.plan.client_ranks[client]
        out = {}
        for name, parts in upload.items():
            if len(parts) < 2:
                B, A = truncate_factors(*global_[name], r_i)
                parts = {"B": B, "A": A, **parts}
            out[name] = (parts["B"], parts["A"])
        return out

    # ------------------------------------------------------------------ client
    def client_init(self, global_init: Factors, client: int) -> Factors:
        """A new client's factors: the first r_i columns of B_g and rows of A_g (Alg. 1 l.4)."""
        return {n: truncate_factors(B, A, self.plan.client_ranks[client]) for n, (B, A) in global_init.items()}

    def start_round(self, received: Factors, own: Factors, client: int, rnd: int) -> Factors:
        """The factors client ``client`` trains from in round ``rnd``, given what it received and its own factors
        from the end of its last round (default, FedIT: the received ones at its rank r_i)."""
        return {n: truncate_factors(B, A, self.plan.client_ranks[client]) for n, (B, A) in received.items()}

    def fold(self, received: Factors, client: int, rnd: int) -> Factors | None:
        """Applied factors whose product client ``client`` adds to its frozen base weights for round
        ``rnd``'s training only (Fed-PLoRA's Select-N-Fold: the modules it does not train); None (default): none."""
        return None

    @property
    def folds(self) -> bool:
        """Whether clients fold part of what they receive into their base weights (declares :meth:`fold`)."""
        return "fold" in self.uses

    @classmethod
    def writes_base(cls) -> str:
        """How the method writes the frozen base weights W_0, or ``""`` if it never does: merges (FedEx-LoRA, FLoRA),
        folds (Fed-PLoRA), or a personal phase over the global adapter frozen in them (FedDPA). A quantized base
        (``fedpa.base_quantization``) cannot take such writes."""
        if "merge" in cls.uses:
            return "merges into the base weights after every aggregation (FedEx-LoRA's residual, FLoRA's stack)"
        if "fold" in cls.uses:
            return "folds the modules a client does not train into its base weights"
        if "personal_start" in cls.uses:
            return "trains its personal adapter over the global adapter written into the base weights"
        return ""

    def personal_start(self, received: Factors, personal: Factors | None, client: int, rnd: int) -> Factors | None:
        """The personal adapter client ``client`` trains in round ``rnd`` before the global one, with the model
        applying ``a * personal + (1 - a) * received`` (``a = personal_weight``, the received reference frozen);
        ``personal`` is what it kept from its last personal phase (None before the first). None (default): no
        personal phase this round."""
        return None

    def load(self, model, state: Factors, trainable: bool | tuple[bool, bool], client: int, rnd: int) -> None:
        """Put client ``client``'s ``state`` (as the model takes it: PEFT's raw factors) into ``model`` for round
        ``rnd``, trainable as ``trainable`` says (default: as the LoRA factors, :func:`fs_fedpa.lora.set_factors`)."""
        lora.set_factors(model, state, trainable=trainable)

    def read(self, model) -> Factors:
        """The state ``model`` holds (default: its live LoRA factors, PEFT's raw ones)."""
        return lora.get_factors(model)

    def trainable(self, rnd: int) -> tuple[bool, bool]:
        """Whether (B, A) are trained in round ``rnd``."""
        return True, True

    def alignment(self, local: Factors, reference: Factors, lam: float) -> Tensor | None:
        """Extra local loss for factors ``local`` (the model's live parameters) and a fixed ``reference`` in their
        frame (:meth:`fs_fedpa.lora.ClientSpace.into_model`); None for none."""
        return None

    def product_alignment(self) -> bool:
        """Whether :meth:`alignment` is lam/2 * sum_m ||B_m A_m - B_r,m A_r,m||_F^2 (FedPA-LoRA's product penalty):
        the client then trains with it batched by shape, its gradient in closed form
        (:class:`~fs_fedpa.core.batched_penalty.ProductTerm`), and calls :meth:`alignment` for no step."""
        return False

    def end_round(self, local: Factors, client: int, rnd: int) -> Factors:
        """What the client keeps of its trained factors (e.g. pruned ones); default: all of them."""
        return local

    def before_upload(self, local: Factors, received: Factors, rnd: int) -> Factors:
        """The factors a client uploads, from its kept ones and what it received this round."""
        return local

    def evaluation_factors(
        self, received: Factors, own: Factors, client: int, personal: Factors | None = None
    ) -> Factors:
        """What the paper protocol evaluates on client ``client`` (``personal``: its personal adapter, if the
        method keeps one): the received global reference by default."""
        return received


def seeded_subset(tag: str, seed: int, rnd: int, client: int, n: int, k: int) -> list[int]:
    """``k`` of ``range(n)`` (sorted) drawn uniformly for client ``client`` in round ``rnd``, from a stream every
    worker derives alike (blake2b of ``tag``, seed, round and client; Python's hash() may differ between workers)."""
    if k >= n:
        return list(range(n))
    key = hashlib.blake2b(f"{tag}:{seed}:{rnd}:{client}".encode(), digest_size=8).digest()
    stream = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    return sorted(torch.randperm(n, generator=stream)[:k].tolist())


def complete_selected(upload: dict[str, dict[str, Tensor]], global_: Factors, place) -> Factors:
    """Full factors, module by module, from an upload of only the items (modules, heads) a client drew:
    ``place(name, parts, global_[name])`` puts the sent ones in place among the global ones, or raises ValueError
    for a shape that does not fit (the server drops the upload with the message)."""
    return {name: place(name, parts, global_[name]) for name, parts in upload.items()}


def trainer_shares(selections: Sequence[Sequence[int]], weights: Sequence[float], n: int) -> Tensor:
    """``(N, n)`` float64: upload i's share of item j (a module, a head) in a mean over the uploads that trained it,
    ``w_i / sum_{i' in Q_j} w_i'`` for i in Q_j, else 0; an item nobody trained takes the first upload whole (every
    completed upload holds the global value there). ``selections[i]``: the items upload i trained."""
    trained = torch.zeros(len(selections), n, dtype=torch.float64)
    for row, chosen in enumerate(selections):
        trained[row, list(chosen)] = float(weights[row])
    total = trained.sum(0)
    first = (torch.arange(len(selections)) == 0).to(torch.float64)[:, None].expand_as(trained)
    return torch.where(total > 0, trained / total.clamp_min(1e-300), first)


def option_parts() -> dict[str, type]:
    """``{section: options dataclass}`` of every method that declares its own keys (``fedpa.<section>.*``)."""
    get_method("fedpa")  # imports every method module
    return {cls.name: cls.options for cls in METHODS.values() if cls.__dict__.get("options")}


def get_method(name: str) -> type[FederatedMethod]:
    """The class registered as ``name``; importing every method module registers it."""
    import importlib

    from fs_fedpa.methods.catalog import names

    for module in names():
        importlib.import_module(f"fs_fedpa.methods.{module}")
    if name not in METHODS:
        raise ValueError(f"unknown federated method {name!r}; known: {sorted(METHODS)}")
    return METHODS[name]
