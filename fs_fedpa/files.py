"""Reading a file whole, bounded: only a regular file, its size checked before a byte is read (a FIFO is never waited
on, ``/dev/zero`` or a sparse 20 GB file never read until memory runs out); FS's yaml read before FS starts (FS's
own errors for a yaml it cannot read name neither the file nor the cause). No FederatedScope import.
"""

from __future__ import annotations

import os
import stat


def memory_bound() -> int:
    """The most bytes a file is read whole when nothing tighter is known: half the machine's memory."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 2**34


def read_regular(path, limit: int, what: str) -> bytes:
    """The bytes of ``path``, read only if it is a regular file of at most ``limit`` bytes: opened without blocking
    (a FIFO is refused, not waited on), its type and size checked before a byte is read (``/dev/zero`` or a sparse
    20 GB file is refused, not read until memory runs out). ValueError beginning with ``what`` (which names the
    file) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"{what} cannot be read: no such file") from None
    except OSError as err:
        raise ValueError(f"{what} cannot be read: it cannot be opened ({err.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        mode = info.st_mode
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket")  # fmt: skip
        raise ValueError(f"{what} cannot be read: it is {kind}, not a regular file")
    with os.fdopen(fd, "rb") as f:
        size = info.st_size
        if size > limit:
            raise ValueError(f"{what} cannot be read: it is {size} bytes, more than the {limit} it can be")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what} cannot be read: it grew past {limit} bytes while it was read")
    return data


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
