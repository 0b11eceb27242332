"""``fs-fedpa run --cfg FILE [KEY VALUE ...]``: FS's own main with the plugin, for a person at a terminal.

FS's main runs unchanged in a child process (``python -m federatedscope.main``, which is how FS users call it); this
reads what it prints. The config dump stays in the run's ``config.yaml`` (FS writes it there) instead of the screen; a
warning repeated word for word is shown once and counted; a bar shows the rounds with the time left; and the end says
where the run went, its final metrics under both evaluation protocols, its summary file (and tracker), and the
command that exports it. Everything the child printed is kept, unfiltered, in ``<run folder>/console.log``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from fs_fedpa.files import read_config
from fs_fedpa.fs_results import ROUND_START, last_weighted_avg
from fs_fedpa.run_summary import SUMMARY_FILE, protocols, read_summary
from fs_fedpa.tools import cli

PROG = "fs-fedpa run"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \((\w+):\d+\) ?(\w+): (.*)$")  # FS's log format
_ERROR = re.compile(r"^(\w+(?:Error|Exception)): (.+)$")
_PY_WARNING = re.compile(r"^(\S+):\d+: (\w*Warning): (.+)$")  # warnings.warn's "file:line: Category: text"


class Console:
    """What one FS run printed, read line by line: the run folder, the rounds, warnings, the last error."""

    def __init__(self, out=sys.stderr):
        self.out, self.lines = out, []
        self.run_folder: Path | None = None
        self.total: int | None = None
        self.warnings: Counter[str] = Counter()
        self.error: str | None = None
        self.in_dump, self.bar, self.round = False, None, 0

    def feed(self, raw: str) -> None:
        self.lines.append(raw)
        line = _ANSI.sub("", raw).rstrip("\n")
        record = _RECORD.match(line)
        if self.in_dump and record is None:  # FS's "the used configs are:" record runs over many lines
            if m := re.match(r"^\s+total_round_num: (\d+)$", line):
                self.total = int(m.group(1))
            return
        self.in_dump = False
        if record is None:  # a record's continuation, or a print or warning of a library: kept in console.log
            if m := _PY_WARNING.match(line):
                self._warn("warning", f"{m.group(2)}: {m.group(3)}")
            elif (m := _ERROR.match(line.strip())) and self.error is None:
                self.error = f"{m.group(1)}: {m.group(2)}"
            return
        _, level, message = record.groups()
        if message.startswith("the used configs are:"):
            self.in_dump = True
        elif message.startswith("the output dir is "):
            self.run_folder = Path(message[len("the output dir is ") :].strip())
        elif m := ROUND_START.search(message):
            self._advance(int(m.group(1)))
        elif level in ("WARNING", "ERROR", "CRITICAL"):
            self._warn(level.lower(), message)

    def _warn(self, level: str, message: str) -> None:
        """Shown the first time; a repeat is counted (FS warns of the same thing for every client and round)."""
        self.warnings[message] += 1
        if self.warnings[message] == 1:
            self._show(f"{level}: {message}")

    def _advance(self, rnd: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=self.total, desc="rounds", unit="round", file=self.out, dynamic_ncols=True)
        self.bar.update(rnd - self.round)  # round r starts: r rounds are done
        self.round = rnd

    def _show(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.out)
        else:
            print(text, file=self.out, flush=True)

    def close(self, finished: bool) -> None:
        if self.bar is not None:
            if finished and self.total:
                self.bar.update(self.total - self.round)
            self.bar.close()
        repeated = {m: n for m, n in self.warnings.items() if n > 1}
        for message, n in sorted(repeated.items(), key=lambda item: -item[1])[:5]:
            print(f"  ({n}x) {message[:160]}", file=self.out)


def final_metrics(run_folder: Path) -> dict[str, float]:
    """The last server evaluation's weighted means: from the run's ``summary.json`` (each client's own factors as
    ``local.<key>``), or FS's ``eval_results.log`` for a run without one; accuracies, F1 and losses."""
    summary = read_summary(run_folder)
    if summary is not None:
        final = summary.get("final") or {}
        last = {**final.get("global", {}), **{f"local.{k}": v for k, v in final.get("own", {}).items()}}
    else:
        log = run_folder / "eval_results.log"
        last = last_weighted_avg(log) if log.is_file() else {}
    return {k: float(v) for k, v in last.items() if k.endswith(("_acc", "_f1", "avg_loss")) and v is not None}


def summary(run_folder: Path, seconds: float) -> str:
    """The end of a run: where it went, its final metrics under the paper protocol (the global reference with the
    client's own local tensors) and each client's own factors (``local.``), its summary file and tracker, and the
    export command."""
    paper, own = protocols(final_metrics(run_folder))
    show = lambda m: ", ".join(f"{k} {v:.4f}" for k, v in sorted(m.items())) or "none recorded"  # noqa: E731
    lines = [f"done in {seconds:.0f} s; the run's folder: {run_folder}",
             f"  final, global adapter (paper protocol): {show(paper)}"]  # fmt: skip
    if own:
        lines.append(f"  final, each client's own factors:       {show(own)}")
    if (recorded := read_summary(run_folder)) is not None:
        lines.append(f"  its summary (time, memory, bytes, privacy, every evaluation): {run_folder / SUMMARY_FILE}")
        tracker = recorded.get("tracker") or {}
        if tracker.get("open"):
            lines.append(f"  its {tracker['kind']} records: {tracker['open']}")
    if (run_folder / "final_checkpoint.pt").is_file() or (run_folder / "checkpoint.pt").is_file():
        lines.append(f"  export it as PEFT adapters: fs-fedpa export {run_folder} --out {run_folder / 'export'}")
    lines.append(f"  FS's full output: {run_folder / 'console.log'}; the config it ran: {run_folder / 'config.yaml'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog=PROG, description="train with FederatedScope's own main and the fs_fedpa plugin")
    parser.add_argument("--cfg", required=True, help="the FS yaml")
    parser.add_argument("opts", nargs="*", help="FS overrides, KEY VALUE ...")
    args = parser.parse_args(argv)
    if len(args.opts) % 2:
        parser.error(f"FS overrides come in KEY VALUE pairs; got {len(args.opts)} words: {' '.join(args.opts)}")
    try:
        read_config(args.cfg)  # FS's own errors for an unreadable yaml name neither the file nor the cause
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "federatedscope.main", "--cfg", args.cfg, *args.opts]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    console, start = Console(), time.time()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        try:
            for line in proc.stdout:
                console.feed(line)
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
    console.close(proc.returncode == 0)
    if console.run_folder is not None and console.run_folder.is_dir():
        (console.run_folder / "console.log").write_text(_ANSI.sub("", "".join(console.lines)), encoding="utf-8")
    if proc.returncode != 0:
        where = f"; FS's output: {console.run_folder / 'console.log'}" if console.run_folder else ""
        error = console.error or f"FS exited with {proc.returncode}"
        error = error[len("ValueError: ") :] if error.startswith("ValueError: ") else error  # a refused value
        print(f"{PROG}: error: {error}{where}", file=sys.stderr)
        return 2 if console.error and console.error.startswith("ValueError") else 1
    print(summary(console.run_folder, time.time() - start) if console.run_folder else "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
