"""What the launcher shows and returns: workers' output with their rank in front, the launcher's
own lines, how a worker ended, the job's exit code and the folders where ranks report a stall.

Every mode (local.py, elastic.py, mpirun.py) words its last line and picks its exit code here, so
a job ends with the same kind of line whichever way its workers were started.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import sys
import tempfile
import threading

from fastxfer import _safefile
from fastxfer.comm import segments

# A job's stall-report folder: <tmp>/fastxfer-report-<launcher pid>-<random>; a rank that gives up
# waiting writes there which rank stalled (csrc/transport/shm/segment.cc)
REPORT_PREFIX = "fastxfer-report-"


def say(line: str) -> None:
    """The launcher's own messages on stderr; a stderr that went away (SIGHUP, closed pipe) is not an error."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def describe_exit(code: int) -> str:
    """'exit code 3' or 'killed by SIGKILL', from a Popen return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def exit_code(returncode: int) -> int:
    """The launcher's exit code for a worker's (or mpirun's) return code: a signal's is 128 + its
    number, as a shell reports it."""
    return 128 - returncode if returncode < 0 else returncode


def rank_file(directory: str, rank: int, name: str):
    """DIR/rank.R/NAME opened for appending (horovodrun's --output-filename layout)."""
    folder = os.path.join(directory, f"rank.{rank}")
    os.makedirs(folder, exist_ok=True)
    if os.path.islink(folder):
        raise PermissionError(f"{folder} is a symbolic link: fastxfer does not write through links; remove it or "
                              f"choose another --output-filename")
    # never through a link planted at the file, never into another user's file (fastxfer/_safefile.py)
    return _safefile.open_append(os.path.join(folder, name))


def pump(stream, out, prefix: bytes, lock: threading.Lock, copy=None) -> None:
    """Copies a worker's pipe to `out` line by line, each line with `prefix` ("[3] ") in front;
    `lock` keeps lines of different workers whole; `copy`, a file, gets each line as it is."""
    broken = False
    for line in iter(stream.readline, b""):
        if copy is not None:
            copy.write(line)
            copy.flush()
        if broken:
            continue  # keep draining, so a worker never blocks on a full pipe
        with lock:
            try:
                out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                out.flush()
            except OSError:  # the terminal went away (EIO after SIGHUP) or the reader closed the pipe
                broken = True
    stream.close()
    if copy is not None:
        copy.close()


def describe_all(procs, noun: str, skip: int | None = None) -> list[str]:
    """'rank 0: exit code 0', ... for every worker but `skip`; `noun` is 'rank' or 'worker'."""
    return [f"{noun} {i}: {describe_exit(p.returncode)}" for i, p in enumerate(procs) if i != skip]


def say_stopped(why: str, noun: str, procs) -> None:
    """The last line of a job the launcher stopped because it got a stop signal (`why` says which)."""
    say(f"fastxfer run: job stopped: the launcher {why}; all {noun}s stopped ({', '.join(describe_all(procs, noun))})")


def say_failed(procs, first: int, reports: dict[int, tuple[int, str]]) -> None:
    """The last line of a job whose rank `first` failed first: that rank and how it ended, and how
    the others did. When `first` gave up waiting for a peer (its stall report names another rank),
    the line blames that peer: the first to fail was only the messenger."""
    code = procs[first].returncode
    others = describe_all(procs, "rank", skip=first)
    tail = f"; {', '.join(others)}" if others else ""
    # A rank that finished early while the others still submit fails too (its own shutdown saw
    # them), but only they report it: whichever exits first, the line names the one that finished.
    if first not in reports or reports[first][0] == first:
        named = [(r, rep) for r, rep in sorted(reports.items()) if rep[0] == first and rep[1] == "finished"]
        if named:
            by, (_, _, msg) = named[0]
            say(f"fastxfer run: job failed: rank {first} finished while the others still ran collectives (named by "
                f"rank {by}: {msg}); rank {first} failed ({describe_exit(code)})" + tail)
            return
    if first in reports and reports[first][0] != first:
        culprit, kind, msg = reports[first]
        if kind == "finished":
            say(f"fastxfer run: job failed: rank {culprit} finished while the others still ran collectives (named by "
                f"rank {first}: {msg}); rank {first} failed ({describe_exit(code)})" + tail)
        elif kind == "failed":
            say(f"fastxfer run: job failed: rank {culprit} failed (named by rank {first}: {msg}); rank {first} "
                f"failed because of it ({describe_exit(code)})" + tail)
        else:
            say(f"fastxfer run: job failed: rank {culprit} stalled (named by rank {first}: {msg}); rank {first} gave "
                f"up waiting for it ({describe_exit(code)})" + tail)
    else:
        say(f"fastxfer run: job failed: rank {first} failed first ({describe_exit(code)})" + tail)


def make_report_dir() -> str:
    """A fresh stall-report folder for a job of this launcher (owner-only, as mkdtemp makes it)."""
    return tempfile.mkdtemp(prefix=f"{REPORT_PREFIX}{os.getpid()}-")


def read_stall_reports(report_dir: str, ranks: int) -> dict[int, tuple[int, str, str]]:
    """rank -> (the rank it blames, how: "stalled", "finished" or "failed", its message), from the reports the
    ranks' engines write when they fail because of another rank (csrc/transport/shm/segment.cc)."""
    reports = {}
    for r in range(ranks):
        try:
            with open(os.path.join(report_dir, f"stall.{r}")) as f:
                head, _, msg = f.read().partition("\n")
            culprit, _, kind = head.partition(" ")
            reports[r] = (int(culprit), kind or "stalled", msg.strip())
        except (OSError, ValueError):
            continue
    return reports


def sweep_stale_report_dirs() -> list[str]:
    """Remove this user's stall-report folders whose launcher (pid in the name) is gone (a launcher
    killed with SIGKILL cannot remove its own)."""
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), REPORT_PREFIX + "*")):
        try:
            pid = int(os.path.basename(path)[len(REPORT_PREFIX):].split("-", 1)[0])
            if os.lstat(path).st_uid != os.getuid() or segments.pid_alive(pid):
                continue
            shutil.rmtree(path)
            removed.append(path)
        except (ValueError, OSError):
            continue
    return removed
