"""Export a finished run's adapters as standard PEFT directories (docs/export.md).

``python -m fs_fedpa.tools.export RUN --out DIR [--clients] [--force]``: RUN is the run's FS output folder (its
``config.yaml`` names the checkpoint and the clients' end states), or a checkpoint with ``--cfg``. A refusal is one
line on stderr and exit status 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import logging
import sys
import zipfile
from pathlib import Path


def config_file(run: Path, cfg: str | None) -> Path | None:
    """The config the export will read: ``RUN/config.yaml``, that of the one run folder inside FS's outdir, or
    ``--cfg`` for a checkpoint; None where :func:`fs_fedpa.plugin.export_run_fs.run_files` refuses the run itself."""
    if run.is_dir():
        found = [run / "config.yaml"] if (run / "config.yaml").is_file() else sorted(run.glob("*/config.yaml"))
        return found[0] if len(found) == 1 else None
    return Path(cfg) if cfg is not None else None


def input_refusal(run: Path, cfg: Path | None) -> str | None:
    """What is wrong with the inputs that needs no FS to see, or None: a missing RUN or config, a config that is not
    a YAML mapping, a RUN file that is not a checkpoint (torch.save writes a zip archive; anything else would reach
    torch's unpickler, whose errors are tracebacks)."""
    import yaml

    if not run.exists():
        return f"{run}: no such run folder or checkpoint"
    if cfg is not None:
        if not cfg.is_file():
            return f"{cfg}: no such config file (--cfg)"
        try:
            parsed = yaml.safe_load(cfg.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            return f"{cfg} is not a readable config: malformed YAML{at} ({getattr(exc, 'problem', None) or exc})"
        if not isinstance(parsed, dict):
            return f"{cfg} is not a config: FS's configs are YAML mappings of options, not a {type(parsed).__name__}"
    if run.is_file() and not zipfile.is_zipfile(run):
        return f"{run} is not a checkpoint (torch.save's zip archive): give federate.save_to's file or the run folder"
    return None


def config_refusal(cfg: Path) -> str | None:
    """Why FS does not take ``cfg`` over its defaults (an unknown key, a value of another type, a value its checks
    refuse), in one line; None when it does."""
    from federatedscope.core.configs.config import global_cfg

    merged = global_cfg.clone()
    try:
        with open(cfg) as f:
            merged.merge_from_other_cfg(merged.load_cfg(f))
    except (KeyError, ValueError, TypeError, AssertionError) as exc:
        return f"{cfg} is not a config FS takes: {exc.args[0] if exc.args else type(exc).__name__}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the run's FS output folder, or its checkpoint (then --cfg)")
    parser.add_argument("--out", required=True, help="the export folder (created; must be empty unless --force)")
    parser.add_argument("--clients", action="store_true", help="also write every client's own model")
    parser.add_argument("--cfg", help="the run's config, when RUN is a checkpoint")
    parser.add_argument("--force", action="store_true", help="write into a non-empty folder")
    args = parser.parse_args(argv)
    cfg = config_file(Path(args.run), args.cfg)
    if refusal := input_refusal(Path(args.run), cfg):
        print(f"export: {refusal}", file=sys.stderr)
        return 2
    import federatedscope  # noqa: F401  (fs_fedpa registers its config with FS on import)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the base model's load report and progress are not the export's output:
    hf_logging.disable_progress_bar()  # a refusal is one line
    logging.getLogger("federatedscope.core.configs").setLevel(logging.ERROR)  # nor FS's remarks on the run's devices

    from fs_fedpa.export import manifest
    from fs_fedpa.plugin.export_run_fs import export_run

    try:
        if cfg is not None and (refusal := config_refusal(cfg)):
            raise ValueError(refusal)
        out = export_run(args.run, args.out, clients=args.clients, force=args.force, cfg_file=args.cfg)
    except ValueError as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    info = manifest(out)
    parts = f"{len(info['clients'])} clients' heads" + (" and models" if args.clients else "")
    print(f"exported {info['method']} ({info.get('rounds')} rounds) to {out}: global/, {parts}; see {out}/README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
