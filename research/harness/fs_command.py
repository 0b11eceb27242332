"""KEY VALUE overrides for ``federatedscope.main``'s command line, safe from its client-config split.

FS's ``parse_client_cfg`` (federatedscope/core/cmd_args.py) moves every word of the overrides that begins with
``client``, and the word after it, into the client config: values as well as keys. So ``fedpa.dp.mode client``
loses its value and pairs ``fedpa.dp.mode`` with the next key. A value written as a Python string literal
(``'client'``) reads back as the same string (yacs decodes values with ``literal_eval``) and escapes the split.

FS's ``train.optimizer`` node takes any key (``new_allowed``, passed on to ``torch.optim``), but yacs accepts a key
it does not know only from a yaml file, never from the command line: ``train.optimizer.momentum 0.9`` there fails
with ``KeyError``. :func:`with_yaml_keys` moves such keys into a copy of the config.

FS's own errors for a yaml it cannot read name neither the file nor the cause: :func:`read_config` reads it first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fs_fedpa.files import read_regular

# FS's config nodes that take keys they do not define (federatedscope/core/configs/cfg_training.py), and the keys
# FS defines in them, which the command line may set
OPEN_NODES = {"train.optimizer": ("type", "lr"), "train.scheduler": ("type", "warmup_ratio")}


def fs_overrides(opts: Sequence[str]) -> list[str]:
    """``opts`` (KEY VALUE ...) with each value that begins with ``client`` quoted as a string literal."""
    return [repr(word) if i % 2 and word.startswith("client") else word for i, word in enumerate(opts)]


def with_yaml_keys(cfg: str, opts: Sequence[str], folder: Path) -> tuple[str, list[str]]:
    """``cfg`` and ``opts`` for FS's command line, with each key of ``opts`` that FS defines only by a yaml file (a
    key of an :data:`OPEN_NODES` node that FS does not define, e.g. ``train.optimizer.momentum``) written into a
    copy of ``cfg`` in ``folder`` instead; ``cfg`` unchanged when there is none. The last value of a key wins."""
    import yaml  # only here: the runner's --plan runs where PyYAML (an FS dependency) may be missing

    keep, moved = [], {}
    for key, value in zip(opts[::2], opts[1::2]):
        node, _, leaf = key.rpartition(".")
        if node in OPEN_NODES and leaf not in OPEN_NODES[node]:
            moved[key] = yaml.safe_load(value)
        else:
            keep += [key, value]
    if not moved:
        return cfg, list(opts)
    data = yaml.safe_load(Path(cfg).read_text()) or {}
    for key, value in moved.items():
        node = data
        for part in key.split(".")[:-1]:
            node = node.setdefault(part, {})
        node[key.rsplit(".", 1)[1]] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config_with_open_keys.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path), keep


CONFIG_LIMIT = 1 << 20  # bytes: an FS yaml is a few KiB; a larger file is not one


def read_config(path: str, flag: str = "--cfg") -> dict:
    """The mapping the FS yaml at ``path`` holds, read before FS starts. ValueError, one line naming ``flag``, the
    file and the cause: no such file, not a regular file (a folder, a FIFO: never blocks), over
    :data:`CONFIG_LIMIT`, not UTF-8, a YAML error (with its line and column), or no mapping at the top."""
    import yaml  # an FS dependency; only here, so the tools' --help needs none

    where = f"{flag} {path}"
    raw = read_regular(path, CONFIG_LIMIT, f"{where}:")  # a FIFO is refused, never waited on
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
