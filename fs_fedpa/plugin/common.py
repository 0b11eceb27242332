"""What the FedPA client and server both derive from an FS config and a model, and how either sends a message."""

from __future__ import annotations

import torch
from federatedscope.core.message import Message
from torch import Tensor, nn

from fs_fedpa.core.ranks import RankPlan
from fs_fedpa.lora import built_rank, lora_layers
from fs_fedpa.methods import FederatedMethod, get_method
from fs_fedpa.plugin.config_fs import fedpa_config


def build_method(cfg, model: nn.Module) -> FederatedMethod:
    """The configured method with its rank plan; checks every rank against every adapted layer."""
    fedpa = fedpa_config(cfg)
    layers = lora_layers(model)
    if not layers:
        raise ValueError(
            f"federate.method {cfg.federate.method!r} needs a model with PEFT LoRA modules "
            "(e.g. llm.adapter.use: True with adapter_method: lora); this model has none"
        )
    adapter_rank = max(built_rank(layer) for layer in layers.values())  # not the live rank: see built_rank
    n = cfg.federate.client_num
    plan = RankPlan.build(
        n,
        adapter_rank,
        client_ranks=fedpa.per_client("client_ranks", n),
        reference_ranks=fedpa.per_client("reference_ranks", n),
    )
    plan = share_equal("plan", plan)  # its per-client tuples: O(N) a client, O(N^2) for a standalone run's clients
    shapes = share_equal("shapes", layer_shapes(model))
    for name, (d, k) in shapes.items():
        plan.check_layer(d, k, name)
    seed = fedpa.seed if fedpa.seed >= 0 else int(cfg.seed)
    method = get_method(cfg.federate.method.lower())(fedpa, plan, seed=seed)
    method.bind(shapes)
    return method


_PEER: dict[str, object] = {}  # the last worker's value of each kind, which the next may share


def share_equal(kind: str, value):
    """``value``, or the equal one of ``kind`` that the previous worker of this process holds. FS's standalone
    runner gives every client a deep copy of the whole config, each trainer's context a set of every parameter name
    of the shared model, and every client builds its own rank plan (per-client tuples of length N) and module tables:
    shared, FS's setup costs 17 KiB a client instead of 117 (docs/dev/plugin.md). All are read-only once set up: the
    config is frozen and an unfrozen one is never shared. A trainer wrapper that defrosts and edits a shared config
    (FS's FedProx and NbAFL do) edits it for its sharers too, which is harmless where, as there, every client makes
    the same edit; the next client's config is then unequal and keeps its own."""
    frozen = getattr(value, "is_frozen", lambda: True)()
    last = _PEER.get(kind)
    if frozen and last is not None and last is not value and type(last) is type(value) and last == value:
        return last
    if frozen:
        _PEER[kind] = value
    return value


def layer_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``name -> (d, k)`` = (out_features, in_features) of every LoRA-adapted layer."""
    return {name: (int(layer.out_features), int(layer.in_features)) for name, layer in lora_layers(model).items()}


def global_init(model: nn.Module, method: FederatedMethod) -> dict[str, tuple[Tensor, Tensor]]:
    """(B_g^(0), A_g^(0)), identical on the server and every client: all draw from the same seed."""
    return method.init_global(layer_shapes(model), torch.Generator().manual_seed(method.seed))


def non_lora_trainables(model: nn.Module, local_patterns) -> tuple[list[str], list[str]]:
    """Names of trainable non-LoRA parameters: ``(local, shared)`` by ``personalization.local_param``.

    Local ones (e.g. a classifier head) never leave the client; shared ones are averaged.
    """
    names = [name for name, _ in model.named_parameters()]
    if unmatched := [pat for pat in local_patterns if not any(pat in name for name in names)]:
        raise ValueError(
            f"personalization.local_param {unmatched} matches no parameter of the model (its names look like "
            f"{names[-1]!r}); a pattern is a substring of a parameter name"
        )
    lora = {id(p) for p in _lora_params(model)}
    local, shared = [], []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in lora:
            (local if any(pat in name for pat in local_patterns) else shared).append(name)
    return local, shared


def _lora_params(model: nn.Module):
    """The LoRA factors of every adapted layer and the parameters of its Ravan heads, if any."""
    for layer in lora_layers(model).values():
        adapter = layer.active_adapters[0]
        yield layer.lora_A[adapter].weight
        yield layer.lora_B[adapter].weight
        if (heads := getattr(layer, "fedpa_heads", None)) is not None:
            yield from heads.parameters()


def without_empty_splits(metrics: dict) -> tuple[dict, list[str]]:
    """FS evaluation metrics without the splits (``val``, ``local.val``, ...) that evaluated 0 examples, and those
    splits: a split with no example has no loss or accuracy, and FS would report (and average) 0.0 for it."""
    empty = sorted(k[: -len("_total")] for k, v in metrics.items() if k.endswith("_total") and v == 0)
    return {k: v for k, v in metrics.items() if k.split("_")[0] not in empty}, empty


def send(worker, msg_type: str, receiver: int, content, timestamp: float, state: int | None = None) -> None:
    """One FS message from ``worker`` (client or server) to ``receiver``, at the worker's round unless ``state``."""
    worker.comm_manager.send(
        Message(
            msg_type=msg_type,
            sender=worker.ID,
            receiver=[receiver],
            state=worker.state if state is None else state,
            timestamp=timestamp,
            content=content,
        )
    )
