"""What README.md, yaml_configs/README.md, research/README.md and docs/*.md tell a user to run or open, read out of the Markdown.

The doc tests (tests/unit/test_docs.py, tests/integration/test_docs_fs.py) check each item against the checkout:
links and repository paths exist, every command's program exists, its flags are in its ``--help``, its config keys
exist. Placeholders (``<GLUE dir>``, ``NAME``, ``...``) are not checked.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = sorted((ROOT / "docs").glob("*.md"))  # the user's guide; the study and the developers' notes apart
DOC_FILES = sorted([ROOT / "README.md", ROOT / "yaml_configs" / "README.md", ROOT / "research" / "README.md",
                    *(ROOT / "docs").glob("**/*.md")])  # fmt: skip

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)
PROGRAMS = ("python ", "python3 ", "./run.sh", "scripts/", "research/")
REPO_PATH = re.compile(r"^(?:fs_fedpa|research|docs|yaml_configs|scripts|tests|\.ci)/[\w./{},*-]*$")
PLACEHOLDER = re.compile(r"[<>…]|\.\.\.|^[A-Z][A-Z_]+$|\{|^\[|\]$")
FS_MAIN = ("federatedscope.main", "federatedscope/main.py")  # FS's entry point: as a module, from an FS checkout
CONFIG_KEY = re.compile(r"^[a-z][a-z_0-9]*(?:\.[a-z][a-z_0-9]*)+$")


@dataclass(frozen=True)
class Command:
    doc: str  # the doc's path relative to the checkout
    text: str  # the command as written, continuation lines joined
    argv: tuple[str, ...]  # its words, environment assignments and comments dropped

    def __str__(self) -> str:
        return f"{self.doc}: {self.text}"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose(text: str) -> str:
    """The Markdown without its fenced code blocks."""
    return FENCE.sub("", text)


def spans(text: str) -> list[str]:
    """Every inline code span outside fenced blocks."""
    return SPAN.findall(prose(text))


def links(text: str) -> list[str]:
    """Every Markdown link and image target outside code, web links and mail excluded."""
    return [t for t in LINK.findall(SPAN.sub("", prose(text))) if not re.match(r"^[a-z]+:", t)]


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    out = set()
    for heading in HEADING.findall(prose(text)):
        heading = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        out.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return out


def _words(line: str) -> tuple[str, ...]:
    line = re.sub(r"<[^<>\n]*>", "PLACEHOLDER", line)  # `<GLUE dir>`: one word, never checked
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose-like code: not a command
        return ()
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words.pop(0)
    return tuple(words)


def commands(path: Path) -> list[Command]:
    """The commands a doc shows: fenced lines and inline spans that run python, ./run.sh, scripts/ or
    research/ (after any VAR=value prefix)."""
    text, out = path.read_text(encoding="utf-8"), []
    candidates = []
    for block in FENCE.findall(text):
        candidates += re.sub(r"\\\n\s*", " ", block).splitlines()
    candidates += spans(text)
    for line in candidates:
        line = line.strip()
        bare = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)+", "", line)
        if bare.startswith(PROGRAMS) and (argv := _words(line)):
            out.append(Command(rel(path), line, argv))
    return out


def all_commands() -> list[Command]:
    return [c for path in DOC_FILES for c in commands(path)]


def flags(argv: tuple[str, ...]) -> list[str]:
    """The long options a command passes, `--name` of `--name=value` included."""
    words = [w.strip("[]") for w in argv]  # `[--clients]`: an optional flag in a usage line
    return [w.split("=")[0] for w in words if w.startswith("--") and len(w) > 2 and not PLACEHOLDER.search(w)]


FILE_SUFFIXES = (".yaml", ".py", ".json", ".jsonl", ".md", ".key", ".ckpt", ".pt", ".tsv", ".txt", ".safetensors")


def config_keys(argv: tuple[str, ...]) -> list[str]:
    """The dotted FS config keys among a command's words (``fedpa.lam 2.0``, ``data.root <dir>``): not the module
    after ``-m``, not file names."""
    return [
        w for i, w in enumerate(argv)
        if CONFIG_KEY.match(w) and not w.endswith(FILE_SUFFIXES) and not (i and argv[i - 1] == "-m")
    ]  # fmt: skip


def is_placeholder(word: str) -> bool:
    return bool(PLACEHOLDER.search(word))


def expand(path: str) -> list[str]:
    """``client_{1,2,3}.yaml`` -> its three names."""
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    return [
        e for part in match.group(1).split(",") for e in expand(path[: match.start()] + part + path[match.end() :])
    ]
