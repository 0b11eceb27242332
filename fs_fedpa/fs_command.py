"""KEY VALUE overrides for ``federatedscope.main``'s command line, safe from its client-config split.

FS's ``parse_client_cfg`` (federatedscope/core/cmd_args.py) moves every word of the overrides that begins with
``client``, and the word after it, into the client config: values as well as keys. So ``fedpa.dp_mode client``
loses its value and pairs ``fedpa.dp_mode`` with the next key. A value written as a Python string literal
(``'client'``) reads back as the same string (yacs decodes values with ``literal_eval``) and escapes the split.
"""

from __future__ import annotations

from collections.abc import Sequence


def fs_overrides(opts: Sequence[str]) -> list[str]:
    """``opts`` (KEY VALUE ...) with each value that begins with ``client`` quoted as a string literal."""
    return [repr(word) if i % 2 and word.startswith("client") else word for i, word in enumerate(opts)]
