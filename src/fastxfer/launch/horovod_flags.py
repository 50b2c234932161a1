"""horovodrun's command line on ``fastxfer run`` (and the ``horovodrun`` command, cli.horovodrun).

Every horovodrun flag is accepted: one that has a meaning here is honoured (most become a
FASTXFER_* setting the workers inherit, docs/configuration.md), one that has none is accepted with
one line on stderr saying why, so job scripts and schedulers' templates run unchanged.
docs/launchers.md has the table in words.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket

from fastxfer import settings

# flags accepted with one line saying why they change nothing here: flag -> (argparse kwargs, why)
NO_MEANING = {
    "--cycle-time-ms": (dict(type=float), "fastxfer's engine has no background cycle: a collective starts as soon "
                        "as every rank has submitted it"),
    "--cache-capacity": (dict(type=int), "fastxfer keeps no response cache: negotiation is one round in shared "
                         "memory"),
    "--disable-cache": (dict(action="store_true"), "fastxfer keeps no response cache"),
    "--hierarchical-allreduce": (dict(action="store_true"), "fastxfer's allreduce is always hierarchical across "
                                 "hosts (shared memory within a host, MPI between hosts)"),
    "--hierarchical-allgather": (dict(action="store_true"), "fastxfer's allgather is always hierarchical across "
                                 "hosts"),
    "--autotune": (dict(action="store_true"), "fastxfer has no autotuner: the bucket cap and engine settings have "
                   "measured defaults (docs/algorithms.md); set --fusion-threshold-mb to choose"),
    "--autotune-log-file": (dict(), "fastxfer has no autotuner"),
    "--autotune-warmup-samples": (dict(type=int), "fastxfer has no autotuner"),
    "--autotune-steps-per-sample": (dict(type=int), "fastxfer has no autotuner"),
    "--autotune-bayes-opt-max-samples": (dict(type=int), "fastxfer has no autotuner"),
    "--autotune-gaussian-process-noise": (dict(type=float), "fastxfer has no autotuner"),
    "--num-nccl-streams": (dict(type=int), "NCCL is a GPU library; fastxfer runs on CPUs"),
    "--mpi-threads-disable": (dict(action="store_true"), "fastxfer asks MPI for the thread level it needs only "
                              "between hosts"),
    "--tcp": (dict(action="store_true"), "between hosts fastxfer uses what MPI chooses; on one host, shared memory"),
    "--binding-args": (dict(), "use fastxfer run --bind socket|numa to bind workers to cores and memory"),
    "--thread-affinity": (dict(), "use FASTXFER_ENGINE_CPUS or fastxfer run --bind to place the engine thread"),
    "--prefix-output-with-timestamp": (dict(action="store_true"), "fastxfer prefixes output with the rank only"),
    "--blacklist-cooldown-range": (dict(nargs=2, type=int), "elastic jobs run on one host: no host is blacklisted"),
    "--disable-group-fusion": (dict(action="store_true"), "grouped collectives fuse like the rest; nothing to "
                               "disable"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """horovodrun's flags on `fastxfer run`'s parser (-np, -H/--hosts, --min-np, --max-np are fastxfer
    run's own and take horovodrun's meaning there)."""
    g = p.add_argument_group("horovodrun's flags (docs/launchers.md)")
    g.add_argument("--hostfile", help="a file of `host slots=N` lines (horovodrun's), instead of -H")
    g.add_argument("-p", "--ssh-port", type=int, help="the ssh port of the other hosts (mpirun's daemons)")
    g.add_argument("-i", "--ssh-identity-file", help="the ssh key for the other hosts (mpirun's daemons)")
    g.add_argument("--network-interface", help="the interface(s) for traffic between hosts, comma-separated")
    g.add_argument("--timeline-filename", help="write the job's timeline (one Chrome trace) here: "
                   "FASTXFER_TIMELINE")
    g.add_argument("--timeline-mark-cycles", action="store_true", help="mark every negotiation round on the "
                   "timeline")
    g.add_argument("--fusion-threshold-mb", type=float, help="the fusion bucket cap: FASTXFER_BUCKET_CAP_MB")
    g.add_argument("--output-filename", help="also write each rank's output to DIR/rank.R/stdout and stderr")
    g.add_argument("--start-timeout", type=float, help="seconds the ranks get to find each other at init: "
                   "FASTXFER_ATTACH_TIMEOUT")
    g.add_argument("--gloo-timeout-seconds", type=float, help="as --start-timeout")
    g.add_argument("--stall-check-warning-time-seconds", type=float, help="FASTXFER_STALL_WARNING_S")
    g.add_argument("--stall-check-shutdown-time-seconds", type=float, help="seconds a silent peer is waited for "
                   "before the others fail: FASTXFER_TIMEOUT")
    g.add_argument("--no-stall-check", action="store_true", help="no stall warnings (the timeout still holds)")
    g.add_argument("--verbose", action="store_true", help="say how the job is started")
    g.add_argument("--log-level", choices=["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"],
                   type=str.upper, help="the workers' fastxfer log level (HOROVOD_LOG_LEVEL)")
    g.add_argument("--mpi-args", help="extra arguments for mpirun (jobs across hosts)")
    g.add_argument("--mpi", action="store_true", help="start the ranks through mpirun, even on one host")
    g.add_argument("--gloo", action="store_true", help="start the ranks without MPI (fastxfer run's own way, "
                   "on one host)")
    g.add_argument("--jsrun", action="store_true", help="IBM's jsrun: not supported")
    g.add_argument("--host-discovery-script", help="elastic: a script printing `host:slots` lines; fastxfer's "
                   "elastic jobs run on this host, so it must list this host only")
    g.add_argument("--slots-per-host", "--slots", type=int, help="slots of each host of --hostfile/-H without a count")
    g.add_argument("--reset-limit", type=int, help="elastic: as --max-restarts")
    g.add_argument("--elastic-timeout", type=float, help="elastic: FASTXFER_ELASTIC_TIMEOUT")
    g.add_argument("--check-build", action="store_true", help="print what this installation supports and exit")
    for flag, (kwargs, why) in NO_MEANING.items():
        g.add_argument(flag, help=f"accepted, no effect: {why}", **kwargs)


def join_mpi_args(argv: list[str]) -> list[str]:
    """`--mpi-args "--bind-to none"` as `--mpi-args=--bind-to none` (argparse would take the value for
    a flag of its own)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--":
            return out + argv[i:]
        if argv[i] in ("--mpi-args", "--binding-args") and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def read_hostfile(path: str, default_slots: int | None) -> str:
    """horovodrun's hostfile (`host slots=N` per line, # comments) as --hosts' "h1:n,h2:n"."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise SystemExit(f"fastxfer run: cannot read --hostfile {path}: {e.strerror}") from None
    hosts = []
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = default_slots or 1
        for extra in parts[1:]:
            key, _, value = extra.partition("=")
            if key not in ("slots", "max_slots", "max-slots") or not value.isdigit():
                raise SystemExit(f"fastxfer run: --hostfile {path} line {n}: expected `host slots=N`, got {line!r}")
            if key == "slots":
                slots = int(value)
        hosts.append(f"{parts[0]}:{slots}")
    if not hosts:
        raise SystemExit(f"fastxfer run: --hostfile {path} lists no host")
    return ",".join(hosts)


def is_this_host(name: str) -> bool:
    if name in ("localhost", "127.0.0.1", "::1", "localhost.localdomain"):
        return True
    here = {socket.gethostname(), socket.getfqdn()}
    return name in here or name.split(".")[0] in {h.split(".")[0] for h in here}


def only_this_host(hosts: str) -> int | None:
    """The slots of --hosts when it names only this host (once), else None."""
    items = [h.strip() for h in hosts.split(",") if h.strip()]
    if len(items) != 1:
        return None
    name, _, slots = items[0].partition(":")
    return (int(slots) if slots.isdigit() else 1) if is_this_host(name) else None


def apply(args: argparse.Namespace) -> tuple[dict[str, str], list[str]]:
    """What horovodrun's flags mean for this job: (environment for the workers, lines to print).
    Also settles args.hosts (from --hostfile), args.max_restarts (--reset-limit) and checks
    --host-discovery-script. SystemExit for a flag that cannot be honoured."""
    env: dict[str, str] = {}
    notes: list[str] = []
    if args.jsrun:
        raise SystemExit("fastxfer run: --jsrun (IBM LSF) is not supported; start the job with mpirun or srun")
    if args.mpi and args.gloo:
        raise SystemExit("fastxfer run: --mpi and --gloo exclude each other")
    if args.hostfile:
        if args.hosts:
            raise SystemExit("fastxfer run: give -H/--hosts or --hostfile, not both")
        args.hosts = read_hostfile(args.hostfile, args.slots_per_host)
    elif args.hosts and args.slots_per_host:
        args.hosts = ",".join(h if ":" in h else f"{h}:{args.slots_per_host}" for h in args.hosts.split(","))
    if args.timeline_filename:
        env["FASTXFER_TIMELINE"] = os.path.abspath(args.timeline_filename)
    if args.timeline_mark_cycles:
        env["FASTXFER_TIMELINE_MARK_CYCLES"] = "1"
    if args.fusion_threshold_mb is not None:
        if args.fusion_threshold_mb == 0:
            env["FASTXFER_BUCKET_CAP_MB"] = str(1 / 1024)
            notes.append("--fusion-threshold-mb 0: tensors are not fused beyond 1 KiB buckets (the smallest cap)")
        else:
            env["FASTXFER_BUCKET_CAP_MB"] = repr(args.fusion_threshold_mb)
    for value, name in ((args.start_timeout, "FASTXFER_ATTACH_TIMEOUT"),
                        (args.gloo_timeout_seconds, "FASTXFER_ATTACH_TIMEOUT"),
                        (args.stall_check_warning_time_seconds, "FASTXFER_STALL_WARNING_S"),
                        (args.stall_check_shutdown_time_seconds or None, "FASTXFER_TIMEOUT"),
                        (args.elastic_timeout, "FASTXFER_ELASTIC_TIMEOUT")):
        if value is not None:
            env[name] = repr(float(value))
    if args.no_stall_check:
        env["FASTXFER_STALL_WARNING_S"] = "1e9"
    if args.log_level:
        env["HOROVOD_LOG_LEVEL"] = args.log_level
    if args.output_filename:
        args.output_filename = os.path.abspath(args.output_filename)
    if args.reset_limit is not None:
        if args.max_restarts is not None and args.max_restarts != args.reset_limit:
            raise SystemExit("fastxfer run: --reset-limit and --max-restarts disagree")
        args.max_restarts = args.reset_limit
    if args.host_discovery_script:
        args.max_np = _discovered_slots(args.host_discovery_script, args.max_np)
    for flag, (_, why) in NO_MEANING.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and value is not False:
            notes.append(f"{flag}: accepted, no effect: {why}")
    # refused here, before any worker starts, by the rules the workers would apply (a NaN timeout
    # would switch stall detection off; docs/reliability.md)
    for name, raw in env.items():
        if name.startswith("FASTXFER_"):
            try:
                settings.declaration(name).parse(raw)
            except settings.SettingError as e:
                raise SystemExit(f"fastxfer run: {e} (from a horovodrun flag)") from None
    return env, notes


def _discovered_slots(script: str, max_np: int | None) -> int:
    import subprocess

    try:
        out = subprocess.run([script], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise SystemExit(f"fastxfer run: --host-discovery-script {script} failed: {e}") from None
    slots = 0
    for line in out.split():
        name, _, n = line.partition(":")
        if not is_this_host(name):
            raise SystemExit(f"fastxfer run: --host-discovery-script lists host {name!r}; fastxfer's elastic jobs "
                             "run on this host only (docs/elastic.md)")
        slots += int(n) if n.isdigit() else 1
    if slots < 1:
        raise SystemExit(f"fastxfer run: --host-discovery-script {script} lists no slot")
    return slots if max_np is None else min(max_np, slots)


def mpi_extra(args: argparse.Namespace) -> list[str]:
    """mpirun arguments from --mpi-args, -p, -i and --network-interface."""
    extra = shlex.split(args.mpi_args) if args.mpi_args else []
    ssh = []
    if args.ssh_port:
        ssh += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        ssh += ["-i", args.ssh_identity_file]
    if ssh:
        extra += ["--mca", "plm_ssh_args", " ".join(ssh)]
    if args.network_interface:
        extra += ["--mca", "btl_tcp_if_include", args.network_interface,
                  "--mca", "oob_tcp_if_include", args.network_interface]
    return extra
