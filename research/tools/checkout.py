"""Where a tool finds the files of this project's checkout that are not part of the installed package.

``yaml_configs/``, ``scripts/``, ``research/`` and ``docs/`` stay out of the wheel. A tool that needs them looks, in
this order, at ``--repo DIR``, the working directory, and the checkout this module sits in. A copy of the tool
outside a checkout has none beside it, so the tool stops at start with one line that says how to get one, rather
than failing on a missing file half-way through.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

PACKAGE_CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout research/tools/ sits in
CLONE_HINT = "git clone <fs_fedpa repository> && cd fs_fedpa"


class NoCheckout(SystemExit):
    """No checkout holds the needed paths: an exit whose message (one line, on stderr) says how to get one."""


def is_checkout(folder: Path, needs: Iterable[str]) -> bool:
    """Whether ``folder`` holds every path of ``needs`` (relative, e.g. ``"yaml_configs"``)."""
    return all((folder / need).exists() for need in needs)


def find_checkout(repo: str | None, needs: Iterable[str], tool: str) -> Path:
    """The checkout root (absolute) holding ``needs``: ``repo`` when given, else the working directory, else the
    checkout this module sits in. Exits with one line naming ``tool`` when none does."""
    needs = tuple(needs)
    listed = ", ".join(f"{n}/" for n in needs)
    if repo is not None:
        folder = Path(repo).expanduser().resolve()
        if not is_checkout(folder, needs):
            missing = ", ".join(n for n in needs if not (folder / n).exists())
            raise NoCheckout(f"{tool}: --repo {repo} is not a checkout of fs_fedpa (it lacks {missing})")
        return folder
    for folder in (Path.cwd().resolve(), PACKAGE_CHECKOUT):
        if is_checkout(folder, needs):
            return folder
    raise NoCheckout(
        f"{tool} needs a checkout of fs_fedpa ({listed}), and neither the working directory nor the installed "
        f"package is one: run it from the root of a clone ({CLONE_HINT}) or pass --repo DIR"
    )

