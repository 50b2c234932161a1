"""Whether this host's limits let `fastxfer run` start -np workers, checked before the first one
starts (docs/reliability.md): a launcher that runs out of threads or file descriptors half way
through would leave a job half started, with Python's "can't start new thread" as the only word.

What each worker costs the launcher: a process, three launcher threads (one waits for it, two copy
its output), two pipe ends (two more files with --output-filename). What it costs the host at the
least: the process and its engine thread. The limits read: the soft RLIMIT_NOFILE (raised towards
the hard limit when that suffices), the soft RLIMIT_NPROC less the tasks this user runs (not for
root, which the kernel exempts), kernel.threads-max and the pids cgroup, each less the tasks they
count already.
"""

from __future__ import annotations

import os
import resource

TASKS_PER_WORKER = 5  # the worker, its engine thread, three launcher threads
FILES_PER_WORKER = 2  # the read ends of its stdout and stderr pipes
FILES_SPARE = 64  # the launcher's own files


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _tasks_of_user(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        text = _read(f"/proc/{pid}/status")
        if text is None:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            n += int(fields.get("Threads", "1"))
    return n


def task_room() -> list[tuple[int, str]]:
    """(tasks that may still start, the limit that says so), one entry per limit that applies."""
    out = []
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0:
        out.append((soft - _tasks_of_user(os.geteuid()), f"the process limit of this user (ulimit -u: {soft})"))
    loadavg = _read("/proc/loadavg")
    threads_max = _read("/proc/sys/kernel/threads-max")
    if loadavg and threads_max and threads_max.isdigit():
        total = int(loadavg.split()[3].split("/")[1])
        out.append((int(threads_max) - total, f"kernel.threads-max ({threads_max})"))
    cgroup = _read("/proc/self/cgroup")
    if cgroup:
        for line in cgroup.splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and (parts[1] == "" or "pids" in parts[1].split(",")):
                base = "/sys/fs/cgroup" + ("" if parts[1] == "" else "/pids")
                folder = base + parts[2]
                limit, current = _read(f"{folder}/pids.max"), _read(f"{folder}/pids.current")
                if limit and limit.isdigit() and current and current.isdigit():
                    out.append((int(limit) - int(current), f"the pids cgroup {parts[2]} (pids.max {limit})"))
    return out


def check(np_: int, output_files: bool = False) -> None:
    """SystemExit naming the limit when -np workers cannot all start; raises the soft limit of open
    files towards the hard one when that is what they need."""
    need_files = FILES_SPARE + np_ * (FILES_PER_WORKER + (2 if output_files else 0))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and need_files > soft:
        if hard == resource.RLIM_INFINITY or need_files <= hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need_files, hard))
        else:
            raise SystemExit(f"fastxfer run: -np {np_} needs about {need_files} open files in the launcher, more "
                             f"than this process may open (ulimit -n: soft {soft}, hard {hard}); raise the limit or "
                             f"start fewer workers")
    need_tasks = np_ * TASKS_PER_WORKER
    for room, what in task_room():
        if need_tasks > room:
            raise SystemExit(f"fastxfer run: -np {np_} needs at least {need_tasks} processes and threads (each worker "
                             f"and its engine thread, three launcher threads per worker), but {what} leaves room "
                             f"for {max(room, 0)}; start fewer workers or raise the limit")
