"""``fastxfer run``: start N workers on this host (or hand off to mpirun for several hosts),
prefix their output with their rank, and stop the job when one of them fails.

When a worker fails, the others get a grace period (default 10 s) to notice through fastxfer
(they raise PeerFailureError within a second or so and exit); whoever is still running after it
is sent SIGTERM, then SIGKILL. The exit code is the first failed rank's (128 + signal number for
a signal), and the last line says which rank failed and how. Shared-memory segments of the job
are removed at the end, and segments of earlier jobs whose launcher is gone are swept at start.

Workers die with the launcher: each is started with PR_SET_PDEATHSIG = SIGKILL, so a launcher
that is killed (even with SIGKILL) leaves no rank running. SIGINT, SIGTERM and SIGHUP (the
terminal went away) stop the job cleanly instead: every rank gets SIGTERM, then SIGKILL after
5 s (a second signal: at once); the segments are removed, the exit code is 128 + the signal
number, and the last line says why the job stopped.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from fastxfer import settings
from fastxfer.comm import segments
from fastxfer.errors import FastxferError
from fastxfer.launch import elastic, horovod_flags, limits, local, mpirun, output

# `fastxfer run --help`: what the command does (this module's docstring), then the elastic mode
DESCRIPTION = __doc__ + "\n" + elastic.__doc__



def oversubscribed(ranks: int) -> bool:
    """Says so, once, when this host's ranks outnumber the CPUs this launcher may run on: every rank
    then gets a share of a CPU, and synchronous training moves at the pace of the slowest."""
    cpus = len(os.sched_getaffinity(0))
    if ranks <= cpus:
        return False
    print(f"fastxfer run: warning: {ranks} ranks on {cpus} usable CPU{'s' if cpus != 1 else ''}: oversubscribed; "
          f"each rank gets a share of a CPU and every step waits for the slowest (fine for tests; for speed, "
          f"-np {cpus} or fewer)", file=sys.stderr, flush=True)
    return True

def add_arguments(p: argparse.ArgumentParser) -> None:
    """`fastxfer run`'s arguments, on the `run` sub-command's parser (cli.py)."""
    p.add_argument("-np", "--np", "--num-proc", dest="np", type=int, help="number of workers (required, except "
                   "for an elastic job, where it defaults to --min-np)")
    p.add_argument("--bind", choices=["socket", "numa", "none"], default="none",
                   help="bind each worker to its cores and memory per `fastxfer topo --workers N` (socket: one "
                        "worker per socket when N matches, numa: per NUMA node when N matches, else even "
                        "splits) and set OMP/KMP/TF thread variables; default none")
    p.add_argument("-H", "--hosts", help="h1:n,h2:n — run through mpirun on these hosts (this host alone, e.g. "
                   "localhost:2: a local job, as without it)")
    p.add_argument("--launch-agent", metavar="CMD",
                   help="with --hosts: an ssh-compatible command mpirun starts its daemons with (`CMD HOST "
                        "COMMAND...`), e.g. the simulated hosts' nsenter agent "
                        "(python -m fastxfer.bench.simhosts)")
    p.add_argument("--net", metavar="CIDR",
                   help="with --hosts: the subnet MPI's TCP traffic (and its daemons') must use, e.g. 10.0.0.0/24")
    p.add_argument("--min-np", type=int, metavar="M",
                   help="elastic: keep the job going while at least M workers remain (the script uses "
                        "fastxfer's elastic.run; docs/elastic.md)")
    p.add_argument("--max-np", type=int, metavar="K",
                   help="elastic: at most K workers in a generation (default -np)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="R",
                   help="elastic: start a new worker in a failed one's place, R times in all (default 0)")
    p.add_argument("--grace", type=float, default=settings.get("FASTXFER_GRACE"),
                   help="seconds the other ranks get to stop by themselves after one fails (default 10)")
    horovod_flags.add_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command each worker runs")


def parser(prog: str = "fastxfer run") -> argparse.ArgumentParser:
    """`fastxfer run`'s parser on its own: its errors show its own usage line (cli.py, horovodrun.py)."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"example:\n  {prog} -np 2 --bind socket -- python train.py")
    add_arguments(p)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """`fastxfer run`, once its command line is parsed: checks what the arguments say together, clears
    what dead launchers left behind, and runs the job in its mode -- through mpirun for ``--hosts``
    (mpirun.py), elastic for ``--min-np``/``--max-np``/``--max-restarts`` (elastic.py), else N local
    workers (local.py). Returns the exit code."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.check_build:
        return check_build()
    env, notes = horovod_flags.apply(args)
    for line in notes:
        print(f"fastxfer run: {line}", file=sys.stderr, flush=True)
    os.environ.update(env)  # the workers inherit them (mpirun forwards every FASTXFER_* setting)
    if not command:
        raise SystemExit("fastxfer run: no command given (fastxfer run -np 2 -- python train.py)")
    elastic_mode = any(getattr(args, k, None) is not None for k in ("min_np", "max_np", "max_restarts"))
    if args.np is None:
        if not elastic_mode or args.min_np is None:
            raise SystemExit("fastxfer run: -np is required (fastxfer run -np 2 -- python train.py)")
        args.np = args.min_np
    if args.np < 1:
        raise SystemExit(f"fastxfer run: -np must be at least 1, got {args.np}")
    if not math.isfinite(args.grace) or args.grace < 0:
        raise SystemExit(f"fastxfer run: --grace must be a number of seconds >= 0, not {args.grace}")
    if args.hosts and not args.mpi and not args.launch_agent and not args.net:
        slots = horovod_flags.only_this_host(args.hosts)
        if slots is not None:  # horovodrun -H localhost:N: this host alone, no mpirun needed
            if slots < args.np:
                raise SystemExit(f"fastxfer run: --hosts offers {slots} slots for -np {args.np}")
            args.hosts = None
    if args.mpi and not args.hosts:
        args.hosts = f"localhost:{args.np}"
    if args.gloo and args.hosts:
        raise SystemExit("fastxfer run: --gloo starts the ranks without MPI, which reaches one host only; across "
                         "hosts fastxfer runs through mpirun (drop --gloo)")
    if args.mpi_args and not args.hosts:
        print("fastxfer run: --mpi-args: this job runs on one host without mpirun (add --mpi to use it); ignored",
              file=sys.stderr, flush=True)
    if args.verbose:
        how = f"through mpirun on {args.hosts}" if args.hosts else "on this host"
        print(f"fastxfer run: {args.np} ranks {how}: {' '.join(command)}", file=sys.stderr, flush=True)
    try:
        segments.shm_dir()  # a bad FASTXFER_SHM_DIR is a usage error, before any rank starts
    except FastxferError as e:
        raise SystemExit(f"fastxfer run: {e}") from None
    # what launchers killed with SIGKILL left: their segments and stall-report folders
    segments.sweep_stale()
    output.sweep_stale_report_dirs()
    if elastic_mode and args.hosts:
        raise SystemExit("fastxfer run: elastic jobs (--min-np/--max-np/--max-restarts) run on one host for now; "
                         "across hosts, see docs/elastic.md for how it would run over MPI")
    if args.hosts:
        return mpirun.run(args.np, command, args.hosts, args.launch_agent, args.net,
                          extra=horovod_flags.mpi_extra(args), output_dir=args.output_filename)
    if args.launch_agent or args.net:
        raise SystemExit("fastxfer run: --launch-agent and --net go with --hosts")
    # every worker of this host can start, or none does (launch/limits.py)
    limits.check(max(args.np, getattr(args, "max_np", None) or 0), bool(args.output_filename))
    oversubscribed(max(args.np, getattr(args, "max_np", None) or 0))
    placement = None
    if args.bind != "none":
        from fastxfer import topology
        from fastxfer.errors import TopologyError

        try:
            placement = topology.plan(args.np, prefer=args.bind)["workers"]
        except TopologyError as e:
            raise SystemExit(f"fastxfer run: cannot place {args.np} workers: {e}") from None
        for w in placement:
            print(f"fastxfer run: rank {w['local_rank']}: {w['numactl']}", file=sys.stderr, flush=True)
    if not elastic_mode:
        return local.run(args.np, command, args.grace, placement=placement, output_dir=args.output_filename)
    min_np = args.np if args.min_np is None else args.min_np
    max_np = args.np if args.max_np is None else args.max_np
    restarts = args.max_restarts or 0
    if not 1 <= min_np <= args.np <= max_np:
        raise SystemExit(f"fastxfer run: need 1 <= --min-np ({min_np}) <= -np ({args.np}) <= --max-np ({max_np})")
    if restarts < 0:
        raise SystemExit("fastxfer run: --max-restarts must be >= 0")
    return elastic.run(args.np, command, args.grace, min_np, max_np, restarts, placement=placement,
                       output_dir=args.output_filename)


def check_build() -> int:
    """horovodrun --check-build: what this installation supports."""
    import importlib.util

    import fastxfer

    def mark(ok):
        return "[X]" if ok else "[ ]"

    tf = importlib.util.find_spec("tensorflow") is not None
    mpi = importlib.util.find_spec("mpi4py") is not None
    print(f"fastxfer v{fastxfer.__version__}:\n\nAvailable Frameworks:\n    {mark(tf)} TensorFlow\n    {mark(tf)} Keras"
          f"\n    [ ] PyTorch\n    [ ] MXNet\n\nAvailable Controllers:\n    {mark(mpi)} MPI (between hosts)\n"
          f"    [X] fastxfer (shared memory, one host)\n\nAvailable Tensor Operations:\n    [ ] NCCL\n    [ ] DDL\n"
          f"    [ ] CCL\n    {mark(mpi)} MPI\n    [X] fastxfer shared-memory engine")
    return 0
