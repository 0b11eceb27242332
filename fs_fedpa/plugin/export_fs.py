"""A run's adapters as PEFT directories (layout: :mod:`fs_fedpa.export`), from the live workers at the end of a run
(``fedpa.export.dir``) or from a finished run's files (``python -m fs_fedpa.tools.export``).

Each view is what the run evaluated: the global adapter as the server holds it; client i's paper-protocol model from
``method.evaluation_factors`` on the reference ``method.downlink`` sends it, plus its merges and local tensors; its own
model from its own factors, plus its merges and what it folded into its base weights for its last round.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from fs_fedpa import export, lora
from fs_fedpa.core.ranks import truncate_factors
from fs_fedpa.methods import FederatedMethod
from fs_fedpa.plugin.common import non_lora_trainables
from fs_fedpa.privacy import export_info

logger = logging.getLogger(f"federatedscope.{__name__}")


class Exporter:
    """Writes the views of one run into ``out`` (created; must be empty or absent unless ``force``)."""

    def __init__(self, cfg, model: nn.Module, method: FederatedMethod, out, *, force: bool = False):
        self.cfg, self.model, self.method, self.out = cfg, model, method, Path(out)
        self.scaling = lora.Scaling.of(model)
        alphas, rslora = set(self.scaling.alpha.values()), set(self.scaling.rslora.values())
        if len(alphas) != 1 or len(rslora) != 1:
            raise ValueError(
                f"export needs one lora_alpha and one rsLoRA setting for every module ({alphas}, {rslora})"
            )
        self.alpha, self.rslora = alphas.pop(), rslora.pop()
        self.local_names, self.shared_names = non_lora_trainables(model, cfg.personalization.local_param)
        config = next(iter(_peft_model(model).peft_config.values()))
        self.task_type = str(config.task_type.value if hasattr(config.task_type, "value") else config.task_type or "")
        self.fan_in_fan_out = bool(getattr(config, "fan_in_fan_out", False))
        self.base_model = base_model_name(cfg)
        self.paths = {n: export.module_path(n) for n in lora.lora_layers(model)}
        if self.out.exists() and any(self.out.iterdir()) and not force:
            raise ValueError(f"export folder {self.out} is not empty; pass --force to write into it")
        self.out.mkdir(parents=True, exist_ok=True)
        _unlink_links(self.out)  # with --force: a link inside would send a write outside the folder

    # ------------------------------------------------------------------------------------------------ global
    def write_global(self, global_: dict, merged: dict[str, Tensor], shared: dict[str, Tensor]) -> dict:
        """``global/`` (and ``global_r<R>/`` for the clients' smaller reference ranks): the server's adapter
        ``expand(global_)`` on top of its merges ``merged`` (d, k), with the shared tensors. Returns the manifest's
        ``global`` entry."""
        applied = self.method.expand(global_)
        tensors = export.saved_tensors(shared)
        if self.method.merges and self.method.merge_encoding == "dense":  # FedEx-LoRA: merged weights
            self._write_merged(self.out / "global", applied, merged, shared)
            return {"merged": "global"}
        adapter = self._adapter(applied, merged, tensors)
        self._write(self.out / "global", adapter)
        if self.method.state_is_factors and not merged:
            R_g = max(adapter.ranks().values())
            for R in sorted(set(self.method.plan.reference_ranks) - {R_g}):
                small = {n: truncate_factors(B, A, R) for n, (B, A) in applied.items()}
                self._write(self.out / f"global_r{R}", self._adapter(small, {}, tensors))
        return {"adapter": "global"}

    # ----------------------------------------------------------------------------------------------- clients
    def received(self, client: int, global_: dict, own: dict) -> dict:
        """What client ``client`` received with the final evaluation, applied (a zero reference where the method sends
        none), as the client decodes it."""
        received = self.method.downlink(global_, client - 1)
        for name, (B, A) in own.items():
            received.setdefault(name, (torch.zeros_like(B), torch.zeros_like(A)))
        return received

    def client_entry(self, client: int, state: dict, received: dict, *, own_models: bool) -> dict:
        """Client ``client``'s parts from its end state (``ClientState.state_dict()`` plus ``fold``) and the reference it
        ``received`` last (both applied, the client's space): its head, and with ``own_models`` its own model and any
        client-specific paper-protocol model. Returns its manifest entry."""
        idx, method = client - 1, self.method
        own = state["factors"]
        personal = state.get("personal") or None
        offsets = dict(state.get("base_offset") or {})
        head = {}
        if state.get("local"):
            head = export.saved_tensors(state["local"])
            export.write_tensors(self.out / "heads" / f"client_{client}.safetensors", head)
        head_file = f"heads/client_{client}.safetensors" if head else None
        entry: dict = {"rank": method.plan.client_ranks[idx], "reference_rank": method.plan.reference_ranks[idx]}
        paper = method.evaluation_factors(received, own, idx, personal=personal)
        if method.instance_mix is not None and personal is not None:
            if own_models:
                folder = f"paper_client_{client}"
                self._write(self.out / folder / "global", self._adapter(received, {}, {}))
                self._write(self.out / folder / "personal", self._adapter(personal, {}, {}))
                entry["paper"] = {"mix": {"global": f"{folder}/global", "personal": f"{folder}/personal",
                                          "w": method.instance_mix}, "head": head_file}  # fmt: skip
        elif paper is received:  # the global model at its reference rank R_i (fs_fedpa.export.load finds it)
            entry["paper"] = {"global": True, "head": head_file}
        elif own_models:
            folder = f"paper_client_{client}"
            self._write_view(self.out / folder, paper, offsets, None, head)
            entry["paper"] = self._where(folder)
        if own_models:
            folder = f"client_{client}"
            self._write_view(self.out / folder, own, offsets, state.get("fold"), head)
            entry["local"] = self._where(folder)
        return entry

    def _where(self, folder: str) -> dict:
        return {"merged": folder} if self._merges_dense else {"adapter": folder}

    @property
    def _merges_dense(self) -> bool:
        return self.method.merges and self.method.merge_encoding == "dense"

    def _write_view(self, folder: Path, state: dict, offsets: dict, fold: dict | None, head: dict) -> None:
        """A client's model: ``state`` (applied, the client's space) on its base offsets, plus the product of ``fold``
        (applied); the head as ``modules_to_save``. Without either, the raw factors are those the client loads into
        its model (``B / s(r)``, :meth:`fs_fedpa.lora.ClientSpace.into_model`)."""
        applied = self.method.expand(state)
        if fold:
            applied = {n: (torch.cat([B, fold[n][0].to(B)], 1), torch.cat([A, fold[n][1].to(A)], 0))
                       if n in fold else (B, A) for n, (B, A) in applied.items()}  # fmt: skip
        if self._merges_dense:
            self._write_merged(folder, applied, offsets, head, saved=True)
            return
        self._write(folder, self._adapter(applied, offsets, head))

    # ---------------------------------------------------------------------------------------------- writing
    def _adapter(self, applied: dict, offsets: dict[str, Tensor], tensors: dict) -> export.Adapter:
        """An adapter applying ``applied``'s products plus the dense ``offsets`` (FLoRA's merged stack): with offsets,
        each module's sum written at its numerical rank (:func:`fs_fedpa.export.lora_of_dense`)."""
        if offsets:
            dense = {}
            for n, (B, A) in applied.items():
                total = B.double() @ A.double()
                if n in offsets:
                    total = total + offsets[n].to(total)
                dense[n] = export.lora_of_dense(total.to(B.dtype))
            applied = dense
        return export.Adapter.from_applied({self.paths[n]: pair for n, pair in applied.items()}, self.alpha,
                                           self.rslora, tensors)  # fmt: skip

    def _write(self, folder: Path, adapter: export.Adapter) -> None:
        export.write_adapter(folder, adapter, base_model=self.base_model, task_type=self.task_type or None,
                             fan_in_fan_out=self.fan_in_fan_out)  # fmt: skip

    def _write_merged(self, folder: Path, applied: dict, offsets: dict[str, Tensor], tensors: dict,
                      saved: bool = False) -> None:  # fmt: skip
        """The base model with ``W_0 + offsets + B A`` in every LoRA module and ``tensors`` (FS names, or PEFT's saved
        names with ``saved``) in place, as HF state-dict keys in ``model.safetensors``, and its ``config.json``."""
        weights: dict[str, Tensor] = {}
        layers = lora.lora_layers(self.model)
        for name, layer in layers.items():
            w0 = getattr(layer, "_fedpa_w0", None)
            w0 = layer.get_base_layer().weight if w0 is None else w0
            B, A = applied[name]
            dtype = torch.promote_types(w0.dtype, torch.float32)
            delta = B.to(dtype) @ A.to(dtype)
            if name in offsets:
                delta = delta + offsets[name].to(delta)
            if self.fan_in_fan_out:
                delta = delta.T
            weights[f"{self.paths[name]}.weight"] = (w0.to(dtype) + delta.to(w0.device)).to(w0.dtype)
        for name, p in _peft_model(self.model).state_dict().items():
            if "lora_" in name or ".original_module." in name:
                continue  # the factors (merged above), and a wrapped module's original (its copy is kept)
            key = export.module_path(name).replace(".base_layer.", ".")
            weights.setdefault(key, p)
        for key, value in tensors.items() if saved else export.saved_tensors(tensors).items():
            weights[key[len(export.PEFT_ROOT) :]] = value
        export.write_tensors(folder / export.MERGED, weights)
        _peft_model(self.model).get_base_model().config.save_pretrained(str(folder))

    def finish(self, global_entry: dict, clients: dict[int, dict], run_info: dict) -> None:
        """``export.json`` and ``README.md``."""
        info = {
            "method": self.method.name,
            "task_type": self.task_type,
            "base_model": self.base_model,
            "lora_alpha": self.alpha,
            "use_rslora": self.rslora,
            "client_ranks": list(self.method.plan.client_ranks),
            "reference_ranks": list(self.method.plan.reference_ranks),
            "R_g": self.method.plan.R_g,
            **run_info,
            "global": global_entry,
            "clients": {str(c): e for c, e in sorted(clients.items())},
        }
        (self.out / export.MANIFEST).write_text(json.dumps(info, indent=1))
        (self.out / "README.md").write_text(readme(info))
        logger.info(f"[fedpa] adapters exported to {self.out}")


def _peft_model(model: nn.Module) -> nn.Module:
    """The ``PeftModel`` inside FS's wrapper."""
    from peft import PeftModel

    return next(m for m in model.modules() if isinstance(m, PeftModel))


def base_model_name(cfg) -> str:
    """The run's base model: a local folder (MiniLM's shipped one by name) or a hub name."""
    name = cfg.model.type.split("@")[0]
    if cfg.model.type.lower().endswith("@seqcls_llm"):
        from fs_fedpa.plugin.seqcls import resolve_model_path

        return resolve_model_path(name)
    # a local folder by its absolute path: the export's README loads it from the export folder, not the run's cwd
    return str(Path(name).resolve()) if Path(name).is_dir() else name


def config_hash(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12] if path and os.path.isfile(path) else ""


def _privacy_line(privacy: dict) -> str:
    """The README's line on privacy, from the manifest's ``privacy`` (:func:`fs_fedpa.privacy.export_info`)."""
    if not privacy.get("dp_files"):
        return "differential privacy: none"
    eps, delta = privacy.get("epsilon"), privacy.get("delta")
    spent = f"(epsilon, delta) = ({eps:.4g}, {delta:.3g})" if eps is not None and delta is not None else "epsilon ?"
    return (f"differential privacy: {privacy.get('dp_mode')} level, {spent}, {privacy.get('adjacency')} adjacency, "
            f"{privacy.get('sampling')} sampling, {privacy.get('accountant')}; DP: {', '.join(privacy['dp_files'])}; "
            f"not DP: {', '.join(privacy['not_dp_files']) or 'nothing'}")


def model_card_data(info: dict):
    """The README's metadata as ``huggingface_hub.ModelCardData`` (base model, library, license, tags) plus what
    fs_fedpa trained: the method, rounds and the privacy."""
    from huggingface_hub import ModelCardData

    privacy = info.get("privacy") or {}
    dp = {k: privacy.get(k) for k in ("dp_mode", "epsilon", "delta", "adjacency", "sampling", "accountant")
          if privacy.get(k) is not None}  # fmt: skip
    return ModelCardData(
        base_model=info["base_model"],
        library_name="peft",
        license="other",  # the base model's license governs an adapter of it
        pipeline_tag="text-classification" if info["task_type"] == "SEQ_CLS" else "text-generation",
        tags=["fs_fedpa", "federated-learning", "lora", info["method"]],
        fs_fedpa={
            "method": info["method"],
            "rounds": info.get("rounds"),
            "R_g": info["R_g"],
            "privacy": dp or {"dp_mode": "none"},
        },
    )


def readme(info: dict) -> str:
    """The export's README, a Hugging Face model card: :func:`model_card_data`'s metadata, then what was trained and
    how to load each part."""
    task = info["task_type"]
    auto = "AutoModelForSequenceClassification" if task == "SEQ_CLS" else "AutoModelForCausalLM"
    labels = f", num_labels={info['num_labels']}" if info.get("num_labels") else ""
    accuracy = info.get("final_metrics") or {}
    shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(accuracy.items())) or "not recorded"
    clients = info["clients"]
    first = next(iter(clients), None)
    lines = [
        "",
        f"# {info['method']} adapters, exported by fs_fedpa",
        "",
        f"- method: `{info['method']}`; rounds: {info.get('rounds', '?')}; "
        f"config hash: `{info.get('config_hash', '')}`",
        f"- base model: `{info['base_model']}` ({task or 'no task type'}); lora_alpha {info['lora_alpha']:g}, "
        f"rsLoRA {info['use_rslora']}",
        f"- ranks: clients r_i {info['client_ranks']}, references R_i {info['reference_ranks']}, "
        f"global R_g {info['R_g']}",
        f"- the run's final metrics (weighted over clients; `local.` = the clients' own factors): {shown}",
        f"- frozen base: {info.get('base_quantization', 'none')} quantization (load the same base); "
        f"{_privacy_line(info.get('privacy') or {})}",
        "",
        "## The global model",
        "",
    ]
    if "merged" in info["global"]:
        lines += [
            "`global/` holds merged weights (this method's dense residual has no low-rank form):",
            "```python",
            "from transformers import " + auto,
            f'model = {auto}.from_pretrained("global"{labels})',
            "```",
        ]
    else:
        lines += [
            "`global/` is a PEFT LoRA directory (PEFT applies exactly the update the server aggregated):",
            "```python",
            "from peft import PeftModel",
            "from transformers import " + auto,
            f'model = PeftModel.from_pretrained({auto}.from_pretrained("{info["base_model"]}"{labels}), "global")',
            "```",
        ]
    if first is not None:
        entry = clients[first].get("paper", {})
        lines += [
            "",
            f"## Client {first}'s model (paper protocol: the global reference at its rank R_i and its head)",
            "",
        ]
        if "mix" in entry:
            lines += ["FedDPA mixes two adapters per input; `fs_fedpa.export.load` rebuilds the mixing:"]
            if per_example((info.get("privacy") or {}).get("dp_mode") or "none"):  # the mix reads raw training inputs
                lines += ["", "Under DP-SGD the mix weighs each input by its similarity to the client's training "
                          "inputs: predictions made with it are outside the privacy guarantee.", ""]  # fmt: skip
        elif entry.get("global") and "adapter" in info["global"]:
            head = entry.get("head")
            R_i = clients[first].get("reference_rank", info["R_g"])
            folder = "global" if R_i >= info["R_g"] else f"global_r{R_i}"  # the reference the server sent it
            lines += [
                "```python",
                "from peft import PeftModel",
                *(["from safetensors.torch import load_file"] if head else []),
                "from transformers import " + auto,
                f'model = PeftModel.from_pretrained({auto}.from_pretrained("{info["base_model"]}"{labels}), '
                f'"{folder}")',
                *([f'model.load_state_dict(load_file("{head}"), strict=False)  # its head'] if head else []),
                "```",
                "(another client: its reference rank's `global_r<R>`, or `global` at R_g, and its own head; "
                "`export.json` names both.)",
            ]  # fmt: skip
        else:
            lines += ["This method's paper-protocol model is the client's own; the manifest names it:"]
        lines += [
            "",
            "Any client and protocol, with the manifest `export.json`:",
            "```python",
            "from fs_fedpa.export import load",
            "from transformers import " + auto,
            f'model = load({auto}.from_pretrained("{info["base_model"]}"{labels}), ".", client={first}, '
            'protocol="paper")  # or "local": its own factors (client_<id>/, written with --clients)',
            "```",
        ]
    lines += [
        "",
        "## Contents",
        "",
        "- `global/`: the global adapter; `global_r<R>/`: the same at a client's smaller reference rank R",
        "- `heads/client_<id>.safetensors`: a client's local tensors (its head), under PEFT's saved key names",
        "- `client_<id>/`: a client's own model (its own factors at rank r_i, its head as `modules_to_save`)",
        "- `paper_client_<id>/`: a client's paper-protocol model where it is its own "
        "(FedSA-LoRA, local training, FedDPA)",
        "- `export.json`: per client, which directory and head make each protocol's model",
        "",
        f"Clients exported: {', '.join(clients) or 'none'}."
        + (
            f" Not exported (never trained, no end state): {info['missing_clients']}."
            if info.get("missing_clients")
            else ""
        ),  # fmt: skip
        "",
    ]
    from huggingface_hub import ModelCard

    return str(ModelCard(f"---\n{model_card_data(info).to_yaml()}\n---\n" + "\n".join(lines)))


def check_export_dir(folder: str) -> None:
    """``fedpa.export.dir`` must be absent or an empty folder, and a folder that can be made there: the nearest
    existing ancestor of an absent one must be a writable folder (checked when the server starts, not after every
    round has trained)."""
    if not folder:
        return
    if not os.path.lexists(folder):
        ancestor = os.path.dirname(os.path.abspath(folder))
        while not os.path.lexists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if not os.path.isdir(ancestor):
            raise ValueError(f"fedpa.export.dir {folder!r} cannot be made: {ancestor!r} is not a folder")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise ValueError(f"fedpa.export.dir {folder!r} cannot be made: {ancestor!r} is not writable")
        return
    if os.path.islink(folder) or not os.path.isdir(folder):
        raise ValueError(f"fedpa.export.dir {folder!r} exists and is not a folder: name an empty or new folder")
    if os.listdir(folder):
        raise ValueError(f"fedpa.export.dir {folder!r} is not empty: the run would overwrite another export")


def _unlink_links(folder: Path) -> None:
    """Remove every symbolic link under ``folder`` (files and folders alike), never following one, so that what
    the export then writes there lands inside ``folder``."""
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in [*dirs, *files]:
            if os.path.islink(os.path.join(root, name)):
                os.unlink(os.path.join(root, name))


def run_info(cfg, outdir: Path, rounds: int, missing: list[int]) -> dict:
    """What the README says of the run: rounds, config hash, final metrics from FS's eval_results.log."""
    from fs_fedpa.fs_results import last_weighted_avg

    log = Path(outdir) / "eval_results.log"
    last = last_weighted_avg(log) if log.is_file() else {}
    metrics = {k: float(v) for k, v in last.items() if k.endswith(("_acc", "_loss"))}
    info = {"rounds": rounds, "config_hash": config_hash(Path(outdir) / "config.yaml"), "final_metrics": metrics,
            "missing_clients": missing, "base_quantization": cfg.fedpa.base_quantization,
            "privacy": export_info(cfg.fedpa, Path(outdir))}  # fmt: skip
    if cfg.model.type.lower().endswith("@seqcls_llm"):
        info["num_labels"] = int(cfg.model.seqcls.num_labels)
    return info


def export_client(cfg, model, method, client: int, state: dict, received, factors) -> None:
    """Client ``client``'s head (and with ``fedpa.export.clients`` its own models) into ``fedpa.export.dir``, with its
    manifest entry ``export_client_<id>.json``. ``state``: what it keeps (:meth:`ClientModel.snapshot` with its fold
    and scaling); ``received``: the reference of its last evaluation (None: the global adapter, from ``factors``)."""
    out = method.cfg.export.dir
    exporter = Exporter(cfg, model, method, out, force=True)
    received = received or exporter.received(client, {}, factors)
    cpu = {n: (B.cpu(), A.cpu()) for n, (B, A) in received.items()}
    entry = exporter.client_entry(client, state, cpu, own_models=method.cfg.export.clients)
    path = os.path.join(out, f"export_client_{client}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({str(client): entry}, f)
    os.replace(path + ".tmp", path)


def per_example(mode: str) -> bool:
    """Whether a run of DP mode ``mode`` (an export's manifest) trained by DP-SGD on each client's records."""
    from fs_fedpa.privacy.registry import entry

    return entry(mode).per_example
