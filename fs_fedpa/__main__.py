"""``fs-fedpa`` (or ``python -m fs_fedpa``): one command for a user's tasks, each a tool of ``fs_fedpa.tools``.

    fs-fedpa run --cfg FILE [KEY VALUE ...]    train with FS's own main and the plugin (fs_fedpa.tools.run)
    fs-fedpa export RUN --out DIR [--clients]  a finished run's adapters as PEFT directories
    fs-fedpa dp-table [--sample ...]           the noise a DP setting adds against the largest signal
    fs-fedpa eval-generation TASK --ckpt ...   a generation task's score (GSM8K, HumanEval) of a checkpoint
    fs-fedpa tiny-llm DIR                      a tiny random causal LM and data, to try the plugin on a CPU
    fs-fedpa config-doc [--check]              docs/config.md's tables of the ``fedpa:`` keys

Comparing methods is FS's own runner with another ``federate.method``; the study's grid runner and the ops tools
live in the checkout's ``research/``, outside the package.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "run": ("fs_fedpa.tools.run", "train with FederatedScope's own main and the plugin"),
    "export": ("fs_fedpa.tools.export", "a finished run's adapters as PEFT directories"),
    "dp-table": ("fs_fedpa.tools.dp_table", "the noise a DP setting adds against the largest signal"),
    "eval-generation": ("fs_fedpa.tools.eval_generation", "a generation task's score of a run's checkpoint"),
    "tiny-llm": ("fs_fedpa.tools.tiny_llm", "a tiny random causal LM and data, to try the plugin on a CPU"),
    "config-doc": ("fs_fedpa.tools.config_doc", "docs/config.md's tables of the fedpa: keys, from the config"),
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
