"""Reading a file whole, bounded: only a regular file, its size checked before a byte is read (a FIFO is never waited
on, ``/dev/zero`` or a sparse 20 GB file never read until memory runs out). No FederatedScope import.
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
