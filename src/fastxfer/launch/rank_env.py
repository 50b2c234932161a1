"""``python -m fastxfer.launch.rank_env -- COMMAND...``: what `fastxfer run --hosts` starts on each
rank through mpirun. It gives the rank horovodrun's place variables (HOROVOD_RANK, _SIZE,
_LOCAL_RANK, _LOCAL_SIZE, _CROSS_RANK, _CROSS_SIZE) from Open MPI's, for scripts that read them
before init(), then becomes COMMAND (exec: same process, same pid)."""

from __future__ import annotations

import os
import sys


def place(environ) -> dict[str, str]:
    """horovodrun's variables from Open MPI's (hosts filled in order, as mpirun --host maps them)."""
    rank, size = int(environ["OMPI_COMM_WORLD_RANK"]), int(environ["OMPI_COMM_WORLD_SIZE"])
    local_rank = int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
    local_size = int(environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", size))
    cross_rank = rank // local_size if local_size else 0
    return {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size), "HOROVOD_LOCAL_RANK": str(local_rank),
            "HOROVOD_LOCAL_SIZE": str(local_size), "HOROVOD_CROSS_RANK": str(cross_rank),
            "HOROVOD_CROSS_SIZE": str(-(-size // local_size) if local_size else 1)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m fastxfer.launch.rank_env -- COMMAND...", file=sys.stderr)
        return 2
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ.update(place(os.environ))
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"fastxfer run: cannot start {argv[0]!r}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
