"""``fs-fedpa`` (or ``python -m fs_fedpa``): one command for a user's tasks, each a tool of ``fs_fedpa.tools``.

    fs-fedpa run --cfg FILE [KEY VALUE ...]    train with FS's own main and the plugin (fs_fedpa.tools.run)
    fs-fedpa export RUN --out DIR [--clients]  a finished run's adapters as PEFT directories
    fs-fedpa compare --cfg FILE --methods ...  several methods and seeds through one runner, with a table
    fs-fedpa dp-table [--sample ...]           the noise a DP setting adds against the largest signal
    fs-fedpa gpu-check [--tiny]                what this host's accelerator does with the plugin
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "run": ("fs_fedpa.tools.run", "train with FederatedScope's own main and the plugin"),
    "export": ("fs_fedpa.tools.export", "a finished run's adapters as PEFT directories"),
    "compare": ("fs_fedpa.harness.compare", "several methods and seeds through one runner, with a table"),
    "dp-table": ("fs_fedpa.tools.dp_table", "the noise a DP setting adds against the largest signal"),
    "gpu-check": ("fs_fedpa.tools.gpu_check", "what this host's accelerator does with the plugin"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:{width}}  {what}" for name, (_, what) in COMMANDS.items())
    return f"usage: fs-fedpa COMMAND [ARGS]   (fs-fedpa COMMAND --help for its own)\n\ncommands:\n{rows}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"fs-fedpa: error: unknown command {argv[0]!r}; one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    sys.argv = [f"fs-fedpa {argv[0]}", *argv[1:]]  # what a tool's own parser names itself by
    from fs_fedpa.tools import cli

    return int(cli.one_line_errors(module.main, f"fs-fedpa {argv[0]}")(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
