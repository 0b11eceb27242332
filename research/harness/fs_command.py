"""KEY VALUE overrides for ``federatedscope.main``'s command line, safe from its client-config split.

FS's ``parse_client_cfg`` (federatedscope/core/cmd_args.py) moves every word of the overrides that begins with
``client``, and the word after it, into the client config: values as well as keys. So ``fedpa.dp.mode client``
loses its value and pairs ``fedpa.dp.mode`` with the next key. A value written as a Python string literal
(``'client'``) reads back as the same string (yacs decodes values with ``literal_eval``) and escapes the split.

FS's ``train.optimizer`` node takes any key (``new_allowed``, passed on to ``torch.optim``), but yacs accepts a key
it does not know only from a yaml file, never from the command line: ``train.optimizer.momentum 0.9`` there fails
with ``KeyError``. :func:`with_yaml_keys` moves such keys into a copy of the config.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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

