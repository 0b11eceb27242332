"""One table of everything fs_fedpa registers with FederatedScope.

``register_all()`` runs from the start-up hook (``fs_fedpa._boot``) right after
``federatedscope.contrib.configs`` executes, i.e. before FS builds ``global_cfg``. Each entry
registers a *lazy* callable: nothing heavy is imported until FS asks for it, and nothing
registers into an FS dict while FS iterates it.
"""

from __future__ import annotations

from fs_fedpa.plugin import quantization_fs, seqcls
from fs_fedpa.plugin.config_fs import PLUGIN_METHODS, extend_fedpa_cfg

_done = False


def _worker(method: str):
    if method in PLUGIN_METHODS:
        from fs_fedpa.plugin.client import FedPAClient
        from fs_fedpa.plugin.server import FedPAServer

        return {"client": FedPAClient, "server": FedPAServer}
    return None


# (kind, key, callable): kind names federatedscope.register.register_<kind>
REGISTRY = (
    ("config", "fedpa", extend_fedpa_cfg),
    ("config", "fedpa_seqcls", seqcls.extend_seqcls_cfg),
    ("config", "fedpa_quantization", quantization_fs.extend_quantization_cfg),
    ("worker", "fedpa", _worker),
    ("data", "fedpa_glue", seqcls.load_glue_data),
    ("model", "fedpa_seqcls", seqcls.build_seqcls_model),
    ("model", "fedpa_quantized_llm", quantization_fs.build_quantized_llm),
    ("trainer", "fedpa_seqcls", seqcls.seqcls_trainer),
    *(("metric", f"fedpa_{name}", fn) for name, fn in seqcls.METRICS),
)


def register_all() -> None:
    """Register every entry of REGISTRY once; a key already taken by someone else is an error."""
    global _done
    if _done:
        return
    from federatedscope import register

    for kind, key, fn in REGISTRY:
        table = getattr(register, f"{kind}_dict")
        if key in table and table[key] is not fn:
            raise RuntimeError(f"fs_fedpa: FederatedScope already has a {kind} registered as {key!r}")
        getattr(register, f"register_{kind}")(key, fn)
    _done = True
