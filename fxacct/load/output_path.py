"""An output file (-o, --trace, --plot) checked when the request is read, before any work: a path
that cannot be written is a usage error naming it. fxacct.report.files writes it (atomically)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from fxacct.errors import UsageError


def check_writable(path: str) -> Path:
    """A UsageError now, before any work, for a path that cannot be written: a directory, a
    missing directory, one the user may not write in. (Writing can still fail: atomic_file.)
    Returns the file to write: a symbolic link's target (the link stays, as open() keeps it)."""
    if not path:
        raise UsageError("an output path is empty: give a file name such as profile.json")
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise UsageError(f"cannot write {path}: it is a directory; give a file name such as {Path(path) / 'profile.json'}")
    if in_place(target):
        if not os.access(target, os.W_OK):
            raise UsageError(f"cannot write {path}: permission denied; choose a writable path")
        return target
    if not target.parent.is_dir():
        raise UsageError(f"cannot write {path}: directory {target.parent} does not exist")
    probe = temporary(target)
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        os.unlink(probe)
    except OSError as e:
        raise _unwritable(path, target, e) from e
    return target


def in_place(target: Path) -> bool:
    """An existing path that is no regular file (/dev/null, a named pipe): written in place, as a
    shell's redirection writes it. The atomic write's rename would put a regular file where the
    device or pipe was (as root, /dev/null itself)."""
    return target.exists() and not target.is_file()


def temporary(target: Path) -> Path:
    # beside the target, so os.replace is a rename within one file system
    return target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"


def _unwritable(path: str, target: Path, e: OSError) -> UsageError:
    return UsageError(f"cannot write {path}: cannot create a file in {target.parent} ({e.strerror or e}); "
                      "choose a writable path")


__all__ = ["check_writable", "in_place", "temporary"]
