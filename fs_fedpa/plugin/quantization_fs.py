"""``fedpa.base_quantization`` in FederatedScope: its checks, what the model builders read, the causal-LM builder.

FS hands a registered model builder ``cfg.model`` alone. So the check, which sees the whole config on every merge and
at ``freeze()``, copies into ``cfg.model.fedpa_base`` what the builders need (never set it by hand): the quantization
in effect (``none`` unless the run selects a method of this plugin) and what FS-LLM's ``get_llm`` reads of the rest
of the config (model cache, the data root and token length of its tokenizer, the adapter). ``<name>@seqcls_llm``
models read it in :func:`fs_fedpa.plugin.seqcls.build_seqcls_model`; :func:`build_quantized_llm` builds
``<name>@huggingface_llm`` models as ``get_llm`` does, with the base quantized, and returns None for a float base so
that FS builds it itself. The loading itself is :mod:`fs_fedpa.quantization` (no FS).
"""

from __future__ import annotations

import logging

from fs_fedpa import quantization
from fs_fedpa.plugin.config_fs import PLUGIN_METHODS

logger = logging.getLogger(f"federatedscope.{__name__}")

NODE = "fedpa_base"  # cfg.model.fedpa_base
SEQCLS = "@seqcls_llm"
CAUSAL = "@huggingface_llm"


def extend_quantization_cfg(cfg) -> None:
    """``cfg.model.fedpa_base``, which :func:`check_quantization` fills (FS ``register_config`` hook)."""
    from federatedscope.core.configs.config import CN

    node = CN()
    node.quantization = "none"  # in effect: fedpa.base_quantization under a method of this plugin, else none
    node.cache_dir = ""  # llm.cache.model
    node.data_root = ""  # data.root
    node.tok_len = 0  # llm.tok_len
    node.adapter_use = False  # llm.adapter.use
    node.adapter_args = [{}]  # llm.adapter.args
    cfg.model[NODE] = node
    cfg.register_cfg_check_fun(check_quantization)


def in_effect(model_config) -> str:
    """The quantization a model builder applies: ``cfg.model.fedpa_base.quantization``, or none."""
    node = model_config.get(NODE) if hasattr(model_config, "get") else None
    return node.quantization if node is not None else "none"


def check_quantization(cfg) -> None:
    """Refuse what a quantized base cannot do (ValueError naming the key), then copy the builders' inputs into
    ``cfg.model.fedpa_base``. A bad value of ``fedpa.base_quantization`` is the fedpa check's to name."""
    wanted = cfg.fedpa.base_quantization
    plugin = str(cfg.federate.method).lower() in PLUGIN_METHODS
    active = wanted if plugin and wanted in quantization.CHOICES else "none"
    if active != "none":
        refuse(cfg, active)
    args = cfg.llm.adapter.args
    values = {
        "quantization": active,
        "cache_dir": cfg.llm.cache.model,
        "data_root": cfg.data.root,
        "tok_len": cfg.llm.tok_len,
        "adapter_use": bool(cfg.llm.adapter.use),
        "adapter_args": [dict(args[0])] if len(args) and args[0] else [{}],
    }
    node = cfg.model[NODE]
    for key, value in values.items():
        if node[key] != value:  # a frozen config that is already in sync is left alone
            node[key] = value


def refuse(cfg, q: str) -> None:
    """ValueError for a run that cannot train on a base quantized to ``q``."""
    kind = str(cfg.model.type)
    if not kind.lower().endswith((SEQCLS, CAUSAL)):
        raise ValueError(
            f"fedpa.base_quantization {q!r} quantizes the base of '<name>{SEQCLS}' and '<name>{CAUSAL}' models; "
            f"model.type is {kind!r}: unset fedpa.base_quantization"
        )
    from fs_fedpa.methods.base import get_method

    method = get_method(cfg.federate.method.lower())
    if how := method.writes_base():
        raise ValueError(
            f"federate.method {method.name!r} {how}, and fedpa.base_quantization {q!r} keeps them quantized and "
            "frozen: unset fedpa.base_quantization, or pick a method that leaves the base alone"
        )
    if kind.lower().endswith(CAUSAL) and not cfg.llm.adapter.use:
        raise ValueError(
            f"fedpa.base_quantization {q!r} freezes the quantized base, and llm.adapter.use False trains every "
            "weight of the model: set llm.adapter.use True (LoRA)"
        )
    if cfg.train.is_enable_half:
        raise ValueError(
            f"train.is_enable_half casts the whole model to float16, which transformers refuses for the base that "
            f"fedpa.base_quantization {q!r} quantizes: unset one of them"
        )
    if problem := quantization.backend_problem(q):
        raise ValueError(problem)


def build_quantized_llm(model_config, input_shape=None):
    """FS model builder: ``<name>@huggingface_llm`` with a quantized base, built as FS-LLM's ``get_llm`` builds it
    (its tokenizer, the embeddings resized to it, ``AdapterModel`` with ``llm.adapter.args``); None for any other
    model or a float base, which FS then builds itself."""
    q = in_effect(model_config)
    if q == "none" or not model_config.type.lower().endswith(CAUSAL):
        return None
    from federatedscope.llm.dataloader import get_tokenizer
    from federatedscope.llm.model.adapter_builder import AdapterModel
    from transformers import AutoModelForCausalLM

    node = model_config[NODE]
    name, hub = model_config.type.split("@")
    cache = {"cache_dir": node.cache_dir} if node.cache_dir else {}
    model = AutoModelForCausalLM.from_pretrained(name, **cache, **quantization.load_kwargs(q))
    quantization.keep_packable_4bit(model)
    logger.info(quantization.describe(model, q))
    tokenizer, num_new_tokens = get_tokenizer(name, node.data_root, node.tok_len, hub)
    _resize_embeddings(model, len(tokenizer), num_new_tokens)
    args = dict(node.adapter_args[0]) if node.adapter_args and node.adapter_args[0] else {}
    return AdapterModel(model, use_adapter=node.adapter_use, **args)


def _resize_embeddings(model, size: int, num_new_tokens: int) -> None:
    """As ``get_llm``: resize to the tokenizer, new tokens' rows the mean of the others (embeddings are not
    quantized)."""
    model.resize_token_embeddings(size)
    if num_new_tokens > 0:
        for weight in (model.get_input_embeddings().weight.data, model.get_output_embeddings().weight.data):
            weight[-num_new_tokens:] = weight[:-num_new_tokens].mean(dim=0, keepdim=True)
