"""Report files (-o, --trace, --plot): written atomically, with the permissions a plain open()
gives under the user's umask; a symbolic link's target is written and the link kept; a device or
a named pipe (/dev/null) is written in place; a path that cannot be written is a usage error
naming it."""

from __future__ import annotations

import contextlib
import os

from fxacct.errors import UsageError
from fxacct.load.output_path import check_writable, in_place, temporary


@contextlib.contextmanager
def atomic_file(path: str, binary: bool = False):
    """Yield a file open for writing; on success it replaces ``path`` in one rename (a reader never
    sees half a report), mode ``0o666 & ~umask`` as open() would give; a device or named pipe is
    written in place (fxacct.load.output_path.in_place). Any OSError on the way is a UsageError
    naming ``path`` (exit 2)."""
    target = check_writable(path)
    tmp = None if in_place(target) else temporary(target)
    try:
        if tmp is None:
            with open(target, "wb" if binary else "w") as f:
                yield f
            return
        # 0o666 less the umask, as open() creates files (tempfile.mkstemp's 0o600 would survive the rename)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb" if binary else "w") as f:
            yield f
        os.replace(tmp, target)
    except OSError as e:
        raise UsageError(f"cannot write {path} ({e.strerror or e}); choose a writable path") from e
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_text(path: str, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


__all__ = ["atomic_file", "check_writable", "write_text"]
