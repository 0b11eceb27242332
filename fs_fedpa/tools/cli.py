"""What every tool's command line shares: a bad input ends in one line that names it, and exit 2 (argparse's code
for a usage error), never a traceback. No torch, no FS."""

from __future__ import annotations

import argparse
import math
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
