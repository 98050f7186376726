"""`stamp`: what tells one version of a file from the next, for the files the gateway
follows (the API keys, a discovery file, the config with `--watch-config`)."""

from __future__ import annotations

import os
from typing import NamedTuple


class Stamp(NamedTuple):
    """A file's identity and version as `stat` gives them: a replacement (an editor's
    rename, a ConfigMap's symlink swap) changes the inode, an edit in place the size or
    the times."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def stamp(path: str) -> Stamp | None:
    """The file's stamp now; None if it cannot be read (absent, no permission)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return Stamp(found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)
