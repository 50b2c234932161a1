"""Where a host's shared-memory segment lives, what it is called, and how the launcher finds the
segments a job left behind. The segment itself (exclusive creation, owner checks, reserved pages)
is csrc/transport/shm/segment.cc; docs/architecture.md ("Shared-memory segments") has the why.

Every ``init()`` creates a new segment under a fresh, unguessable name::

    <FASTXFER_SHM_DIR or /dev/shm>/fastxfer-<pid>-<tag, 32 hex digits>

``<pid>`` is the process whose life bounds the segment's: the ``fastxfer run`` launcher, the host's
first rank under MPI, the process itself when it runs alone. ``<tag>`` is 128 bits no other local
user can predict: under ``fastxfer run`` it is derived (HMAC-SHA256) from a per-job secret the
launcher hands its ranks only in their environment (FASTXFER_JOB_SECRET; /proc/<pid>/environ is
readable by the owner and root alone) and the number of inits so far, so every rank of the host
computes the same name without a listener or a message, and the name one init used says nothing
about the next. Under MPI rank 0 broadcasts 128 fresh random bits at every init.
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import os

from fastxfer import settings

PREFIX = "fastxfer-"
DEFAULT_DIR = "/dev/shm"


def shm_dir() -> str:
    """FASTXFER_SHM_DIR (an existing directory, absolute path), else /dev/shm; SettingError (a
    FastxferError) for anything else."""
    return settings.get("FASTXFER_SHM_DIR")


def job_segment_name(owner_pid: int, job_id: str, secret: str, generation: int) -> str:
    """The file name of a `fastxfer run` job's segment for its `generation`-th init (0, 1, ...)."""
    tag = hmac.new(secret.encode(), f"{job_id}/segment/{generation}".encode(), hashlib.sha256).hexdigest()[:32]
    return f"{PREFIX}{owner_pid}-{tag}"


def random_segment_name(owner_pid: int, token: str, suffix: str = "") -> str:
    """The file name of a segment from a random `token` (MPI rendezvous, a process alone)."""
    return f"{PREFIX}{owner_pid}-{token}{suffix}"


def path(name: str) -> str:
    """The segment file for a name from this module, in shm_dir()."""
    return os.path.join(shm_dir(), name)


def owner_pid(file_name: str) -> int | None:
    """The pid in a segment's file name, or None when it is not one of ours."""
    if not file_name.startswith(PREFIX):
        return None
    try:
        return int(file_name[len(PREFIX):].split("-", 1)[0])
    except ValueError:
        return None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _mine(p: str) -> bool:
    try:
        return os.lstat(p).st_uid == os.getuid()
    except OSError:
        return False


def remove_segments_of(pid: int, directory: str | None = None) -> list[str]:
    """Removes this user's segments whose owning process is `pid` (a launcher at the end of its job)."""
    d = directory or shm_dir()
    removed = []
    for p in glob.glob(os.path.join(d, f"{PREFIX}{pid}-*")):
        if owner_pid(os.path.basename(p)) == pid and _mine(p):
            try:
                os.unlink(p)
                removed.append(p)
            except OSError:
                pass
    return removed


def sweep_stale(directory: str | None = None) -> list[str]:
    """Removes this user's segments whose owning process is gone (a launcher or rank killed while
    its ranks were still attaching: the only window in which a segment's name exists)."""
    d = directory or shm_dir()
    removed = []
    for p in glob.glob(os.path.join(d, PREFIX + "*")):
        pid = owner_pid(os.path.basename(p))
        if pid is None or not _mine(p) or pid_alive(pid):
            continue
        try:
            os.unlink(p)
            removed.append(p)
        except OSError:
            continue
    return removed
