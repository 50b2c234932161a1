"""Writing files in folders other users may share (the system temp folder, a scratch space, a
world-writable output folder): every file fastxfer writes for the user -- timelines, data packs,
the launcher's per-rank output, benchmark results -- goes through here (docs/reliability.md).

The rules:

- A whole file is written to a fresh temporary file in the destination folder (``mkstemp``:
  ``O_CREAT | O_EXCL``, a random name, mode 0600, never an existing file or link) and renamed over
  the destination when complete. A rename replaces a link planted at the destination; it never
  writes through it. In a sticky folder (``/tmp``) another user's file at the destination cannot be
  replaced by a user who is not root: the rename fails, and the error says so.
- A file appended to (``open_append``) is opened with ``O_NOFOLLOW`` and must be a regular file
  this user owns; otherwise PermissionError naming the owner.
- Modes: ``private`` files (timelines: tensor names and timings) 0600; data the user asked for
  (packs, logs, results) 0666 less the umask, as ``open()`` would have made it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import threading
from collections.abc import Iterator
from typing import IO

_umask_lock = threading.Lock()


def umask() -> int:
    """The process's umask (read by setting it back: os has no getter; serialised between threads)."""
    with _umask_lock:
        m = os.umask(0o077)
        os.umask(m)
    return m


def file_mode(private: bool) -> int:
    return 0o600 if private else 0o666 & ~umask()


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


@contextlib.contextmanager
def atomic(path: str | os.PathLike, *, private: bool = False, binary: bool = True,
           temp_suffix: str = ".partial") -> Iterator[IO]:
    """A file object whose contents replace ``path`` once the block ends without an exception (the
    data flushed and synced first); on an exception the temporary file is removed and ``path`` is
    untouched."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=temp_suffix, dir=folder)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), file_mode(private))
        try:
            os.replace(tmp, path)
        except PermissionError as e:
            try:
                st = os.lstat(path)
                who = f": it belongs to {_owner(st.st_uid)}"
            except OSError:
                who = ""
            raise PermissionError(e.errno, f"cannot replace {path}{who} (a sticky folder lets only its owner "
                                           f"replace it); write somewhere else") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write(path: str | os.PathLike, data: bytes | str, *, private: bool = False) -> None:
    """``path`` now holds ``data`` (written as ``atomic`` writes)."""
    with atomic(path, private=private, binary=isinstance(data, bytes)) as f:
        f.write(data)


def copy(src: str | os.PathLike, dst: str | os.PathLike, *, private: bool = False) -> None:
    """``dst`` now holds a copy of ``src`` (written as ``atomic`` writes; ``src`` itself is read
    without following a link)."""
    fd = os.open(os.fspath(src), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f, atomic(dst, private=private) as out:
        while chunk := f.read(1 << 20):
            out.write(chunk)


def open_append(path: str | os.PathLike, *, private: bool = False) -> IO[bytes]:
    """``path`` opened for appending (created if missing), never through a link and never a file of
    another user: PermissionError naming the owner, or saying it is a link or not a regular file."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                     file_mode(private))
    except OSError as e:
        # ELOOP from O_NOFOLLOW; EACCES where the kernel refuses links in sticky folders first
        if e.errno in (errno.ELOOP, errno.EACCES) and os.path.islink(path):
            raise PermissionError(errno.EPERM, f"{path} is a symbolic link: fastxfer does not write through "
                                               f"links; remove it or choose another file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"belongs to {_owner(st.st_uid)}"
        raise PermissionError(errno.EPERM, f"{path} {what}: fastxfer writes only files of its own user; "
                                           f"choose another file")
    return os.fdopen(fd, "ab")


__all__ = ["atomic", "copy", "file_mode", "open_append", "umask", "write"]
