"""``python .../fastxfer/launch/bind.py --cpus LIST [--mems LIST] -- CMD...``: bind this process's
CPUs (sched_setaffinity) and memory (set_mempolicy MPOL_BIND), then exec CMD, which inherits both.
`fastxfer run --bind` starts each worker through it (no numactl binary needed); it also runs as
``python -m fastxfer.launch.bind``."""

from __future__ import annotations

import argparse
import os
import sys

from fastxfer import _core
from fastxfer.errors import TopologyError
from fastxfer.topology import parse_cpu_list


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastxfer.launch.bind")
    ap.add_argument("--cpus", required=True)
    ap.add_argument("--mems", default="")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command")
    try:
        _core.bind_cpus(parse_cpu_list(a.cpus))
        if a.mems:
            _core.bind_memory(parse_cpu_list(a.mems))  # node lists share the grammar
    except TopologyError as e:
        print(f"fastxfer bind: {e}", file=sys.stderr)
        return 1
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        print(f"fastxfer bind: cannot run {cmd[0]!r}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
