"""A finished run's adapters as PEFT directories, from its files: FS's checkpoint with the plugin's ``fedpa`` section
and each client's end state (``python -m fs_fedpa.tools.export``; the views are :mod:`fs_fedpa.plugin.export_fs`'s).
Every input is read as tensors only and checked (its owner, rank plan, finite values) before anything is written.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fs_fedpa import export, lora
from fs_fedpa.methods import FederatedMethod
from fs_fedpa.plugin.export_fs import Exporter, run_info
from fs_fedpa.plugin.global_model import other_plan
from fs_fedpa.plugin.run_folder_fs import CHECKPOINT, identity, same_run
from fs_fedpa.state_checks import owns_storage

logger = logging.getLogger(f"federatedscope.{__name__}")


def run_files(run, cfg_file=None) -> tuple[object, Path, Path]:
    """``(cfg, checkpoint, outdir)`` of a finished run: ``run`` is its FS output folder (its ``config.yaml`` names
    ``federate.save_to``; FS's ``final_`` checkpoint is preferred) or a checkpoint with ``cfg_file``."""
    from federatedscope.core.configs.config import global_cfg

    run = Path(run)
    if run.is_dir():
        cfg_file = run / "config.yaml"
        if not cfg_file.is_file():
            runs = sorted(p.parent for p in run.glob("*/config.yaml"))
            if len(runs) == 1:  # FS's outdir, which holds the run's folder <expname>/
                logger.warning(f"[fedpa] export: {run} holds one run, {runs[0]}: exporting it")
                return run_files(runs[0])
            found = f"; it holds the runs {', '.join(p.name for p in runs)}: name one" if runs else ""
            raise ValueError(
                f"{run} has no config.yaml: give a finished run's FS output folder, or a checkpoint --cfg{found}"
            )
    elif not run.is_file():
        raise ValueError(f"{run}: no such run folder or checkpoint")
    elif cfg_file is None:
        raise ValueError(f"{run} is a checkpoint: name the run's config with --cfg")
    cfg = global_cfg.clone()
    cfg.merge_from_file(str(cfg_file))
    if run.is_file():
        return cfg, run, Path(cfg.outdir)
    save_to = cfg.federate.save_to
    if not save_to and not cfg.fedpa.store.checkpoint:
        raise ValueError(f"{run}: the run saved no checkpoint (fedpa.store.checkpoint False, no federate.save_to)")
    saved = Path(save_to or CHECKPOINT)
    # its own folder first: FS's config.yaml of a run saving into it names the path the run had when it ran
    candidates = [run / saved.name, saved, run.parent / saved] if save_to else [run / CHECKPOINT]
    for place in candidates:
        final = place.parent / f"final_{place.name}"
        for path in (final, place):
            if path.is_file():
                return cfg, path, run
    resume_point = [p for p in candidates if (p.parent / f"fedpa_resume_{p.name}").is_file()]
    if resume_point:
        raise ValueError(f"{run}: the run has not finished (only its resume point {resume_point[0].parent} is there); "
                         "resume it with federate.restore_from, then export")  # fmt: skip
    raise ValueError(f"{run}: no checkpoint found for federate.save_to {save_to or str(run / CHECKPOINT)!r} (looked "
                     f"in {', '.join(dict.fromkeys(str(p.parent) for p in candidates))})")  # fmt: skip


def _another_run(path: Path, owner: dict, asked: Path) -> str:
    return (f"{path} was written by the run in {owner.get('outdir')} (config {owner.get('config') or '?'}), not by "
            f"the run in {Path(asked).resolve()}: both runs saved onto one federate.save_to and the later one "
            "replaced this run's files; nothing is exported. Rerun it without federate.save_to (its files then stay "
            "in its own folder)")  # fmt: skip


def client_file(checkpoint: Path, client: int) -> Path:
    """Where a client's end state lies: ``fedpa_client_<id>_<save_to name>`` beside the checkpoint."""
    name = checkpoint.name[len("final_") :] if checkpoint.name.startswith("final_") else checkpoint.name
    return checkpoint.parent / f"fedpa_client_{client}_{name}"


def export_run(run, out, *, clients: bool = False, force: bool = False, cfg_file=None) -> Path:
    """Export a finished run (see :func:`run_files`) into ``out``; returns ``out``."""
    from federatedscope.core.auxiliaries.model_builder import get_model

    from fs_fedpa.plugin.common import build_method, global_init
    from fs_fedpa.state_checks import check_global

    cfg, checkpoint, outdir = run_files(run, cfg_file)
    saved = export.read_checkpoint(checkpoint)
    section = saved.get("fedpa") if isinstance(saved, dict) else None
    if not isinstance(section, dict) or "global" not in section:
        raise ValueError(f"{checkpoint} is not a checkpoint of an fs_fedpa run (no 'fedpa' section)")
    owner = section.get("run")
    if not _identity(owner):  # a run's checkpoint records it: without one it cannot be told from another run's
        raise ValueError(f"{checkpoint}: field 'fedpa.run' (the identity of the run that wrote it) is {owner!r:.100}; "
                         "a checkpoint fs_fedpa writes records it, so this one cannot be told from another run's "
                         "file; nothing is exported")  # fmt: skip
    if Path(run).is_dir() and not same_run(owner, identity(str(outdir))):  # a file with --cfg: the user's word
        raise ValueError(_another_run(checkpoint, owner, outdir))
    if not isinstance(saved.get("cur_round"), int) or saved["cur_round"] < 1:
        raise ValueError(f"{checkpoint}: the run has no finished round (cur_round {saved.get('cur_round')!r:.40})")
    check_views({"global": section["global"], "merged": section.get("merged", {}), "model": saved.get("model")},
                checkpoint)  # fmt: skip
    paths = {client: client_file(checkpoint, client) for client in range(1, cfg.federate.client_num + 1)}
    missing = [client for client, path in paths.items() if not path.is_file()]
    states = {}  # every input is read and checked before the model is built or anything written
    for client in (c for c in paths if c not in missing):
        states[client] = export.read_checkpoint(paths[client])
        if isinstance(states[client], dict):
            check_views(states[client], paths[client])
            require_finite(states[client], paths[client])
            written_by = states[client].get("run")
            if not _identity(written_by):
                raise ValueError(f"{paths[client]}: field 'run' (the identity of the run that wrote it) is "
                                 f"{written_by!r:.100}; it cannot be told from another run's file; nothing is "
                                 "exported")  # fmt: skip
            standalone = cfg.federate.mode.lower() == "standalone"  # distributed parties keep folders of their own
            if standalone and not same_run(written_by, owner):
                raise ValueError(_another_run(paths[client], written_by, outdir))
    model = get_model(cfg)
    method = build_method(cfg, model)
    if why := other_plan(section, method):
        raise ValueError(f"{checkpoint} {why}")
    plan = method.plan  # the global factors' modules and shapes from the base model, before a value is read
    check_global(section["global"], checkpoint, global_init(model, method), max(plan.r_g, plan.R_g),
                 at=str(checkpoint), field="fedpa.global")  # fmt: skip
    require_finite({"merged": section.get("merged", {})}, checkpoint)
    if method.merges and "merged" not in section:
        raise ValueError(f"{checkpoint}: {method.name} merges into the base weights, and this checkpoint (an older "
                         "fs_fedpa's) does not hold the merged offsets")  # fmt: skip
    if method.merges:
        lora.keep_base(model)
    for client, state in states.items():
        check_state(state, paths[client], client, method)
    scaling = lora.Scaling.of(model)
    check_scaling(section.get("scaling"), scaling, checkpoint)
    for client, state in states.items():
        check_scaling(state.get("scaling"), scaling, paths[client])
    exporter = Exporter(cfg, model, method, out, force=force)
    model_state = {export.module_path(f"model.{k}") if export.PEFT_ROOT in k else k: v
                   for k, v in saved.get("model", {}).items()}  # fmt: skip
    shared = {n: model_state[export.module_path(n)] for n in exporter.shared_names if
              export.module_path(n) in model_state}  # fmt: skip
    require_finite({"model": shared}, checkpoint)
    global_ = section["global"]
    global_entry = exporter.write_global(global_, section.get("merged", {}), shared)
    entries = {}
    for client, state in states.items():
        received = exporter.received(client, global_, state["factors"])
        entries[client] = exporter.client_entry(client, state, received, own_models=clients)
    if missing:
        logger.warning(f"[fedpa] export: clients {missing} have no end state (never trained); they are not exported")
    exporter.finish(global_entry, entries, run_info(cfg, outdir, int(saved["cur_round"]), missing))
    return exporter.out


def _tensors(value, name: str = ""):
    """``(dotted name, tensor)`` of every tensor inside nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{name}.{key}" if name else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{name}[{i}]")


def _identity(recorded) -> bool:
    """Whether ``recorded`` is a run identity as :func:`fs_fedpa.plugin.run_folder_fs.identity` writes it."""
    return isinstance(recorded, dict) and isinstance(recorded.get("outdir"), str) and bool(recorded["outdir"])


def check_views(value, path: Path) -> None:
    """Refuse a tensor whose elements have no storage of their own (a planted stride-0 view of 10^12 elements): from
    its strides and storage size, before any value of it is read."""
    for name, tensor in _tensors(value):
        if tensor.layout != torch.strided or not owns_storage(tensor):
            raise ValueError(f"{path}: tensor {name} is a view of shape {tuple(tensor.shape)} and strides "
                             f"{tensor.stride()} over a smaller storage; refusing to export it")  # fmt: skip


def require_finite(value, path: Path) -> None:
    """Refuse to export a NaN or an infinity: the first tensor holding one is named with its file."""
    for name, tensor in _tensors(value):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{path}: tensor {name} holds NaN or Inf; refusing to export it")


def check_state(state, path: Path, client: int, method: FederatedMethod) -> None:
    """A client's end state must be that client's, of this rank plan and model, its factors applied."""
    if not isinstance(state, dict) or not isinstance(state.get("factors"), dict):
        raise ValueError(f"{path}: not a client end state of fs_fedpa")
    rank = method.plan.client_ranks[client - 1]
    if state.get("client") != client or state.get("rank") != rank:
        raise ValueError(f"{path}: written by client {state.get('client')} at rank {state.get('rank')}; expected "
                         f"client {client} at rank {rank}")  # fmt: skip
    if state.get("space") != "applied":  # an older fs_fedpa kept raw factors (B_i, not s_i B_i)
        raise ValueError(f"{path}: field 'space' is {state.get('space')!r:.40}, not 'applied': its factors are not "
                         "the applied ones (s_i B_i, A_i) this fs_fedpa keeps; export it with the fs_fedpa that wrote "
                         "it")
    if unknown := sorted(set(state["factors"]) - set(method.shapes)):
        raise ValueError(f"{path}: factors of modules {unknown[:3]} that the model does not have")


def check_scaling(recorded, scaling: lora.Scaling, path: Path) -> None:
    """The LoRA scaling ``path`` was trained with (``lora_alpha`` and ``use_rslora`` per module, as the run recorded
    it) must be the one the run's config builds now: the same raw factors under another alpha apply another update.
    Files of an fs_fedpa that recorded none are taken as they are."""
    if recorded is None:
        return
    if not isinstance(recorded, dict) or not all(isinstance(recorded.get(k), dict) for k in ("alpha", "rslora")):
        raise ValueError(f"{path}: its recorded LoRA scaling is not what fs_fedpa writes")
    for name in sorted(recorded["alpha"]):
        then = (recorded["alpha"][name], recorded["rslora"].get(name))
        now = (scaling.alpha.get(name, float("nan")), scaling.rslora.get(name))
        if then != now:
            raise ValueError(
                f"{path}: module {name} was trained with lora_alpha {then[0]:g} (use_rslora {then[1]}), but the "
                f"run's config now builds lora_alpha {now[0]:g} (use_rslora {now[1]}): its factors would apply "
                "another update; export with the config the run was trained with"
            )
