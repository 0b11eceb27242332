"""What every tool's command line shares: a bad input ends in one line that names it, and exit 2 (argparse's code
for a usage error), never a traceback. No torch, no FS."""

from __future__ import annotations

import argparse
import math
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (``prog: error: ...``) without the usage block above it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help shows the usage)\n")


def number(kind: type = float, *, minimum: float | None = None, above: float | None = None,
           maximum: float | None = None, below: float | None = None) -> Callable[[str], float]:  # fmt: skip
    """An argparse ``type``: a finite ``kind`` within the bounds (``above``, ``below``: strictly)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"{text} must be > {above:g}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"{text} must be >= {minimum:g}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{text} must be <= {maximum:g}")
        if below is not None and not value < below:
            raise argparse.ArgumentTypeError(f"{text} must be < {below:g}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def file_in_the_way(folder: Path) -> Path | None:
    """The file at ``folder`` or at one of its parents, which keeps ``folder`` from being made; None if none."""
    return next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)


def one_line_errors(main: Callable[..., int | None], prog: str) -> Callable[..., int]:
    """``main`` with its input errors (ValueError, OSError: a bad value, a path that cannot be read or written) ended
    in one line naming the tool, exit 2."""

    def run(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs) or 0
        except (ValueError, OSError) as exc:
            print(f"{prog}: error: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}",
                  file=sys.stderr)  # fmt: skip
            return 2

    return run


CONFIG_LIMIT = 1 << 20  # bytes: an FS yaml is a few KiB; a larger file is not one


def read_config(path: str, flag: str = "--cfg") -> dict:
    """The mapping the FS yaml at ``path`` holds, read before FS starts. ValueError, one line naming ``flag``, the
    file and the cause: no such file, not a regular file (a folder, a FIFO: never blocks), over
    :data:`CONFIG_LIMIT`, not UTF-8, a YAML error (with its line and column), or no mapping at the top."""
    import yaml  # an FS dependency; only here, so the tools' --help needs none

    where = f"{flag} {path}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO's open would wait for a writer
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except OSError as exc:
        raise ValueError(f"{where}: cannot be read ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError(f"{where}: {'a folder' if stat.S_ISDIR(mode) else 'not a regular file'}, not a yaml")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(CONFIG_LIMIT + 1)
    if len(raw) > CONFIG_LIMIT:
        raise ValueError(f"{where}: larger than {CONFIG_LIMIT >> 20} MiB, not an FS yaml")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        if (mark := getattr(exc, "problem_mark", None)) is not None:  # a syntax error
            line, column, cause = mark.line + 1, mark.column + 1, exc.problem
        else:  # a character YAML does not allow (ReaderError): its position in the text
            before = text[: getattr(exc, "position", 0)]
            line, column = before.count("\n") + 1, len(before) - before.rfind("\n")
            character = getattr(exc, "character", "")
            character = chr(character) if isinstance(character, int) else character
            cause = f"character {character!r}: {getattr(exc, 'reason', None) or 'not allowed'}"
        raise ValueError(f"{where}: not valid YAML at line {line}, column {column}: {cause}") from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a YAML {type(data).__name__}"
        raise ValueError(f"{where}: FS needs a mapping of keys (e.g. 'federate: ...') at the top; got {got}")
    return data
