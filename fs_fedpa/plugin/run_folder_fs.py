"""Where a run's files go, and whose they are. FS writes a run's log, config and results into its own folder
(``cfg.outdir`` after FS's logger set-up: ``<outdir>/<expname>``, or a new ``sub_exp_<time>`` beside an earlier run),
but ``federate.save_to`` is a path of its own, relative to the working directory, so two runs that name one path
overwrite each other's checkpoint, resume points and client files. Here a run without ``federate.save_to`` saves into
its own folder (``fedpa.store.checkpoint``), and every checkpoint and end state records the run that wrote it
(:func:`identity`), which the export compares with the run folder it is asked for.
"""

from __future__ import annotations

import logging
import os

from fs_fedpa.plugin.export_fs import config_hash

logger = logging.getLogger(f"federatedscope.{__name__}")

CHECKPOINT = "checkpoint.pt"  # FS writes the end of the run to final_checkpoint.pt beside it
# the last config given and the copy made of it: FS's standalone runner hands every client an equal clone, and a copy
# (a clone and FS's freeze, about 4 ms) for each of N clients would add to the set-up that share_equal keeps small
_LAST: list = []


def in_run_folder(config):
    """``config``, or a frozen copy with ``federate.save_to`` = ``<outdir>/checkpoint.pt`` when it is empty and
    ``fedpa.store.checkpoint`` is on. Called by the server and each client before FS's constructor reads the path."""
    if config is None or config.federate.save_to or not config.fedpa.store.checkpoint:
        return config
    if _LAST and _LAST[0] == config:
        return _LAST[1]
    given, config = config, config.clone()
    config.defrost()
    config.federate.save_to = os.path.join(config.outdir, CHECKPOINT)
    config.freeze(inform=False, save=False, check_cfg=False)
    _LAST[:] = [given, config]
    return config


def identity(outdir: str) -> dict[str, str]:
    """The run a file belongs to: its FS folder ``outdir`` and the hash of the ``config.yaml`` FS wrote there."""
    outdir = os.path.abspath(outdir)
    return {"outdir": outdir, "config": config_hash(os.path.join(outdir, "config.yaml"))}


def same_run(recorded, expected: dict[str, str]) -> bool:
    """Whether a file's recorded identity is ``expected``'s run. A run folder that was moved keeps its config; a
    config that FS rewrote in place (per-client configs) keeps its folder; another run has neither. Files of an
    fs_fedpa that recorded none are taken as they are."""
    if not isinstance(recorded, dict):
        return True
    folder = os.path.realpath(str(recorded.get("outdir", ""))) == os.path.realpath(expected["outdir"])
    return folder or (bool(recorded.get("config")) and recorded.get("config") == expected["config"])


def warn_if_taken(config, save_to: str, resume_point: str) -> None:
    """At the start of a run with an explicit ``federate.save_to``: say so when another run's checkpoint or resume
    point is already there (it is replaced as this run saves)."""
    head, tail = os.path.split(save_to)
    there = [p for p in (os.path.join(head, f"final_{tail}"), save_to, resume_point) if os.path.isfile(p)]
    restored = config.federate.restore_from
    if not there or (restored and os.path.abspath(restored) in {os.path.abspath(p) for p in there}):
        return  # nothing there, or this run continues from it
    logger.warning(
        f"[fedpa] federate.save_to {save_to!r} already holds {os.path.basename(there[0])} of an earlier run; this run "
        f"({os.path.abspath(config.outdir)}) overwrites it as it saves. Leave federate.save_to unset to keep every "
        "run's files in its own folder"
    )
