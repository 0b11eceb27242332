"""Federated LoRA state out as standard PEFT adapters, and back in. No FederatedScope here.

An export directory (written by :mod:`fs_fedpa.plugin.export_fs`; docs/export.md):

- ``global/``: the global adapter, a PEFT LoRA directory at rank R_g (Ravan's ``H r_h``; FLoRA's merged stack at its
  numerical rank), or a merged model (``model.safetensors``) for FedEx-LoRA, whose dense residual has no low-rank form;
- ``global_r<R>/``: the global adapter at a clients' reference rank R_i < R_g (the first R_i of its R_g directions,
  what the server sends that client);
- ``heads/client_<id>.safetensors``: a client's local tensors (its classifier head) under PEFT's saved key names;
- ``client_<id>/`` (``--clients``): the client's own model, as its own-factor evaluation sees it;
- ``paper_client_<id>/`` (``--clients``, for methods whose paper-protocol model is the client's own: FedSA-LoRA's own
  B, local training; FedDPA's ``global/`` and ``personal/`` adapters, which :class:`InstanceMix` mixes per input);
- ``export.json``: the manifest :func:`load` reads, and ``README.md``.

PEFT applies ``W_0 + (lora_alpha / r) B A``. A directory keeps the run's ``lora_alpha`` (and rsLoRA) and sets ``r``
(``rank_pattern`` where modules differ) to the rank written, so PEFT's forward applies the update the run applied.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

PEFT_ROOT = "base_model.model."  # what PEFT puts before a module's path inside the base model
MANIFEST = "export.json"
WEIGHTS = "adapter_model.safetensors"
MERGED = "model.safetensors"


def module_path(name: str) -> str:
    """The path inside the HF base model of a module or parameter named in a PEFT-wrapped model (FS's
    ``model.base_model.model.bert.encoder...`` -> ``bert.encoder...``), without PEFT's wrapper levels."""
    at = name.find(PEFT_ROOT)
    if at < 0:
        raise ValueError(f"{name!r} is not inside a PEFT model (no {PEFT_ROOT!r} in its name)")
    path = name[at + len(PEFT_ROOT) :]
    for wrapper in (".modules_to_save.default.", ".original_module."):
        path = path.replace(wrapper, ".")
    return path


def saved_tensors(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Non-LoRA tensors (a head) by PEFT's saved key (``base_model.model.classifier.weight``), contiguous copies
    on the CPU: the form ``set_peft_model_state_dict`` reads for ``modules_to_save``."""
    return {PEFT_ROOT + module_path(n): t.detach().to("cpu", copy=True).contiguous() for n, t in tensors.items()}


def scaling(alpha: float, rslora: bool, r: int) -> float:
    """PEFT's ``s(r)``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return alpha / math.sqrt(r) if rslora else alpha / r


@dataclass
class Adapter:
    """One LoRA adapter as PEFT applies it: ``W + s(r) B A`` per module, ``s(r) = scaling(alpha, rslora, r)``.

    ``factors``: module path -> raw ``(B: (d, r), A: (r, k))``; ``tensors``: PEFT saved key -> tensor of the modules
    it replaces whole (``modules_to_save``, e.g. a classifier head)."""

    factors: dict[str, tuple[Tensor, Tensor]]
    alpha: float
    rslora: bool = False
    tensors: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def from_applied(cls, applied: Mapping[str, tuple[Tensor, Tensor]], alpha: float, rslora: bool = False,
                     tensors: Mapping[str, Tensor] | None = None) -> Adapter:  # fmt: skip
        """From applied factors ``(s B, A)`` (product = the update): ``B / s(r)`` at each pair's rank r."""
        raw = {m: (B / scaling(alpha, rslora, B.shape[1]), A) for m, (B, A) in applied.items()}
        return cls(raw, alpha, rslora, dict(tensors or {}))

    def delta(self, module: str) -> Tensor:
        """``s(r) B A`` (d, k) of one module, float64: what PEFT adds to its weight."""
        B, A = self.factors[module]
        return scaling(self.alpha, self.rslora, B.shape[1]) * (B.double() @ A.double())

    def ranks(self) -> dict[str, int]:
        return {m: int(B.shape[1]) for m, (B, _) in self.factors.items()}


def lora_of_dense(delta: Tensor) -> tuple[Tensor, Tensor]:
    """Applied ``(B: (d, rho), A: (rho, k))`` with ``B A = delta`` (d, k) to the float floor: its SVD at its numerical
    rank rho (singular values above ``sigma_1 max(d, k) eps``, at least 1), computed in float64."""
    U, S, Vh = torch.linalg.svd(delta.double(), full_matrices=False)
    eps = torch.finfo(delta.dtype if delta.is_floating_point() else torch.float32).eps
    rho = max(1, int((S > S[0] * max(delta.shape) * eps).sum())) if S.numel() and S[0] > 0 else 1
    return (U[:, :rho] * S[:rho]).to(delta.dtype), Vh[:rho].to(delta.dtype).contiguous()


def write_adapter(path: Path, adapter: Adapter, *, base_model: str, task_type: str | None,
                  fan_in_fan_out: bool = False) -> None:  # fmt: skip
    """``adapter_config.json`` (PEFT's own ``LoraConfig``) and ``adapter_model.safetensors`` under PEFT's key names.
    ``r`` is the most common rank, ``rank_pattern`` names the modules of other ranks."""
    import peft
    from safetensors.torch import save_file

    if task_type == "SEQ_CLS" and not adapter.tensors:
        task_type = None  # PEFT's classifier model requires a head in every adapter; this one carries none

    ranks = adapter.ranks()
    if not ranks:
        raise ValueError("an adapter needs at least one LoRA module")
    r = Counter(ranks.values()).most_common(1)[0][0]
    modules = sorted({k[len(PEFT_ROOT) :].rsplit(".", 1)[0] for k in adapter.tensors})
    config = peft.LoraConfig(
        task_type=task_type,
        r=r,
        lora_alpha=adapter.alpha,
        use_rslora=adapter.rslora,
        lora_dropout=0.0,
        target_modules=sorted(ranks),
        rank_pattern={m: k for m, k in ranks.items() if k != r},
        modules_to_save=modules or None,
        fan_in_fan_out=fan_in_fan_out,
        base_model_name_or_path=base_model,
        inference_mode=True,
    )
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    weights = dict(adapter.tensors)
    for m, (B, A) in adapter.factors.items():
        weights[f"{PEFT_ROOT}{m}.lora_A.weight"] = A.detach().to("cpu", copy=True).contiguous()
        weights[f"{PEFT_ROOT}{m}.lora_B.weight"] = B.detach().to("cpu", copy=True).contiguous()
    save_file(weights, str(path / WEIGHTS), metadata={"format": "pt"})


def write_tensors(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """Tensors (already under their saved names) as one safetensors file."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})  # fmt: skip


def read_tensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


# ------------------------------------------------------------------------------------------------------ loading
def read_checkpoint(path, limit: int | None = None) -> object:
    """A checkpoint or end state, tensors and plain containers only (``weights_only``), read only if it is a regular
    file of at most ``limit`` bytes (default half the machine's memory; never blocking on a FIFO:
    :func:`fs_fedpa.files.read_regular`); anything else (a pickle that needs code, a truncated or foreign file) is
    a ValueError naming the file."""
    import io
    import pickle

    from fs_fedpa.files import memory_bound, read_regular

    data = read_regular(path, memory_bound() if limit is None else limit, f"{path}:")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{path}: holds objects other than tensors (a pickle that runs code); not read") from None
    except (RuntimeError, EOFError, OSError, ValueError, AttributeError) as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{path}: not a tensor file fs_fedpa wrote ({type(exc).__name__}: {reason})") from None


def manifest(export_dir) -> dict:
    """``export.json``, with the entries clients wrote on their own (``export_client_<id>.json``, written at the end
    of a run by each client) added under ``clients``."""
    root = Path(export_dir)
    if not (root / MANIFEST).is_file():
        raise ValueError(f"{export_dir}: no {MANIFEST}; not a directory written by fs_fedpa's export")
    info = json.loads((root / MANIFEST).read_text())
    info.setdefault("clients", {})
    for part in sorted(root.glob("export_client_*.json")):
        info["clients"].update(json.loads(part.read_text()))
    return info


def load(base_model: nn.Module, export_dir, client: int | None = None, protocol: str = "paper"):
    """The model of ``client`` under ``protocol`` (``"paper"``: the global reference at its rank R_i with its local
    tensors; ``"local"``: its own factors) from an export, on ``base_model`` (the run's HF base model, fresh); or the
    global model (``client=None``). Returns a ``PeftModel``, ``base_model`` with merged weights loaded (FedEx-LoRA),
    or an :class:`InstanceMix` (FedDPA's paper protocol). A 4-bit base keeps the weight layout the run evaluated it in
    (:func:`fs_fedpa.quantization.keep_packable_4bit`)."""
    from fs_fedpa.quantization import keep_packable_4bit

    root = Path(export_dir)
    info = manifest(root)
    check_base(base_model, info)
    keep_packable_4bit(base_model)
    if client is None:
        entry = info["global"]
    else:
        if str(client) not in info["clients"]:
            raise ValueError(f"{root}: client {client} was not exported (clients: {sorted(info['clients'], key=int)})")
        entry = info["clients"][str(client)].get(protocol)
        if entry is None:
            raise ValueError(f"{root}: client {client} has no {protocol!r} model (export it with --clients)")
        if entry.get("global"):  # the global model at the client's reference rank, with its head
            entry = {**info["global"], "head": entry.get("head")}
            R_i = info["clients"][str(client)]["reference_rank"]
            if "adapter" in entry and (root / f"global_r{R_i}").is_dir():
                entry["adapter"] = f"global_r{R_i}"
    if "mix" in entry:
        mix = entry["mix"]
        model = _peft(base_model, root / mix["global"])
        _load_head(model, root, entry)
        return InstanceMix(model, read_tensors(root / mix["personal"] / WEIGHTS), mix["w"],
                           classifier=info.get("task_type") == "SEQ_CLS")  # fmt: skip
    if "merged" in entry:
        model = _merged(base_model, root / entry["merged"])
    else:
        model = _peft(base_model, root / entry["adapter"])
    _load_head(model, root, entry)
    return model


def check_base(base_model: nn.Module, info: dict) -> list[str]:
    """Warnings (also logged) where ``base_model`` differs from the base the export was trained on: its name, and
    whether it is quantized (``base_quantization`` of the manifest: an adapter trained on an NF4 base fits that base;
    on another it behaves differently, silently). Returned for the caller."""
    import warnings

    found = []
    trained = info.get("base_model")
    given = getattr(getattr(base_model, "config", None), "_name_or_path", None)
    if trained and given and Path(str(given)).name != Path(str(trained)).name:
        found.append(f"the export was trained on base {trained!r}, and the base given is {given!r}")
    quantized = getattr(base_model, "hf_quantizer", None) is not None or any(
        getattr(base_model, flag, False) for flag in ("is_loaded_in_8bit", "is_loaded_in_4bit"))  # fmt: skip
    expected = info.get("base_quantization", "none")
    if (expected != "none") != quantized:
        found.append(f"the export was trained on a base with {expected!r} quantization, and the base given is "
                     f"{'quantized' if quantized else 'not quantized'}")  # fmt: skip
    for message in found:
        warnings.warn(message, stacklevel=3)
    return found


def _peft(base_model: nn.Module, path: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model, str(path))


def _merged(base_model: nn.Module, path: Path) -> nn.Module:
    missing, unexpected = base_model.load_state_dict(read_tensors(path / MERGED), strict=False)
    if unexpected:
        raise ValueError(f"{path}: tensors {unexpected[:3]} are not in the base model given")
    return base_model


def _load_head(model: nn.Module, root: Path, entry: dict) -> None:
    """A client's local tensors into ``model``: under their PEFT saved names (the classifier is not wrapped in an
    adapter without a head), or their base-model names in a merged model."""
    if not entry.get("head"):
        return
    head = read_tensors(root / entry["head"])
    if "merged" in entry:
        head = {k[len(PEFT_ROOT) :]: v for k, v in head.items()}
    _, unexpected = model.load_state_dict(head, strict=False)
    if unexpected:
        raise ValueError(f"{root / entry['head']}: tensors {unexpected[:3]} are not in the model")


class InstanceMix(nn.Module):
    """FedDPA's test-time model from an export: the ``global`` adapter (rank R_i) and the ``personal`` one (rank r_i)
    mixed per input as ``g_b Delta_g + (1 - g_b) Delta_l`` with ``g_b = w mean_j cos(h(x_b), h(x_bj))``, h the last
    layer's state ([CLS] for a classifier, the last attended token otherwise) under the personal adapter alone and
    x_bj some of the client's training inputs (:func:`fs_fedpa.core.instance.instance_weights`). As the client
    evaluates: one LoRA of rank R_i + r_i, ``[B_g, B_l] [A_g; A_l]``, whose ``lora_A`` output
    :class:`fs_fedpa.lora.RowGate` weighs per row.

    ``mix(references=..., **inputs)``: ``references`` holds ``input_ids`` (and ``attention_mask``) of m training
    inputs per row, ``(n * m, L)``, row b's m first; or pass the weights ``g`` (n,) directly."""

    def __init__(self, model: nn.Module, personal: Mapping[str, Tensor], w: float, classifier: bool):
        super().__init__()
        from fs_fedpa import lora

        self.model, self.w, self.classifier = model, w, classifier
        layers = lora.lora_layers(model)
        both, split = {}, set()
        for name, layer in layers.items():
            adapter = layer.active_adapters[0]
            B_g, A_g = layer.lora_B[adapter].weight, layer.lora_A[adapter].weight
            B_l, A_l = personal[f"{name}.lora_B.weight"], personal[f"{name}.lora_A.weight"]
            R, r = B_g.shape[1], B_l.shape[1]
            s_g, s_l, s = (lora.scaling_for_rank(layer, k) for k in (R, r, R + r))
            B = torch.cat([B_g.detach() * (s_g / s), B_l.to(B_g) * (s_l / s)], dim=1)
            both[name] = (B, torch.cat([A_g.detach(), A_l.to(A_g)], dim=0))
            split.add(R)
        if len(split) != 1:
            raise ValueError(f"the global adapter's ranks differ between modules ({sorted(split)})")
        lora.set_factors(model, both, trainable=False)
        self.gate = lora.RowGate(model, split.pop())

    def representation(self, **inputs) -> Tensor:
        """(n, h): the last layer's state under the personal adapter alone."""
        from fs_fedpa.core.instance import representation

        return representation(self.model, self.gate, inputs, self.classifier)

    def weights(self, inputs: Mapping[str, Tensor], references: Mapping[str, Tensor]) -> Tensor:
        """(n,) the weight g of the global adapter for each input row."""
        from fs_fedpa.core.instance import instance_weights

        keys = ("input_ids", "attention_mask")
        emb = self.representation(**{k: inputs[k] for k in keys if inputs.get(k) is not None})
        ref = self.representation(**{k: references[k] for k in keys if references.get(k) is not None})
        return instance_weights(emb, ref.view(emb.shape[0], -1, ref.shape[-1]), self.w)

    def forward(self, *, g: Tensor | None = None, references: Mapping[str, Tensor] | None = None, **inputs):
        if g is None:
            if references is None:
                raise ValueError("InstanceMix needs references (training inputs per row) or the weights g")
            g = self.weights(inputs, references)
        self.gate.g = g
        try:
            return self.model(**inputs)
        finally:
            self.gate.g = None
