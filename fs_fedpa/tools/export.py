"""Export a finished run's adapters as standard PEFT directories (docs/export.md).

``python -m fs_fedpa.tools.export RUN --out DIR [--clients] [--force]``: RUN is the run's FS output folder (its
``config.yaml`` names the checkpoint and the clients' end states), or a checkpoint with ``--cfg``.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the run's FS output folder, or its checkpoint (then --cfg)")
    parser.add_argument("--out", required=True, help="the export folder (created; must be empty unless --force)")
    parser.add_argument("--clients", action="store_true", help="also write every client's own model")
    parser.add_argument("--cfg", help="the run's config, when RUN is a checkpoint")
    parser.add_argument("--force", action="store_true", help="write into a non-empty folder")
    args = parser.parse_args(argv)
    import federatedscope  # noqa: F401  (fs_fedpa registers its config with FS on import)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the base model's load report and progress are not the export's output:
    hf_logging.disable_progress_bar()  # a refusal is one line

    from fs_fedpa.export import manifest
    from fs_fedpa.plugin.export_run import export_run

    try:
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
