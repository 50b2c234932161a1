"""Joining the job: who am I, how many are we, who shares my host — and the engine behind it.

The layout comes from whichever launcher started the process: ``fastxfer run`` (FASTXFER_RANK,
FASTXFER_SIZE, FASTXFER_LOCAL_RANK, FASTXFER_JOB_ID, FASTXFER_JOB_SECRET; an elastic job's rank and
size from the launcher's rendezvous, comm/rendezvous.py), else any launcher of the table in
comm/launchers.py (mpirun, mpiexec, srun, torchrun, TF_CONFIG, horovodrun...), else none: a single
process. A launcher that announces several processes never leaves one alone: the job forms, or
init() raises an error naming the launcher and the fix.

Ranks that share a host are found by host identity (host name + kernel boot id), exchanged over
MPI, never by trusting a LOCAL_SIZE variable. Every init() gets a fresh shared-memory segment name
(comm/segments.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import secrets
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable

from fastxfer import _core, topology
from fastxfer import log as fxlog
from fastxfer import _validate as check
from fastxfer import settings as config
from fastxfer.settings import horovod as horovod_settings
from fastxfer.comm import host_rendezvous, launchers, rendezvous, segments
from fastxfer.comm.mpi import MPIInterHost
from fastxfer.errors import FastxferError, PeerFailureError


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where this process sits in the job, as the launcher (or the MPI rendezvous) describes it."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    segment: str  # path of this host's shared-memory segment, fresh at every init (comm/segments.py)
    source: str   # which launcher the layout came from
    hosts: int = 1
    inter_host: MPIInterHost | None = None  # the link between hosts when the job spans several
    host_of: tuple[int, ...] = ()  # each rank's host index (hosts in order of their lowest rank)
    mpi_comm: object = None  # COMM_WORLD when the layout came from an MPI rendezvous
    generation: int = 0  # elastic jobs: which generation of the group this is (comm/rendezvous.py)
    clock_offset_us: float = 0.0  # rank 0's steady clock minus this rank's (0 on one host; the timeline)
    member_pids: tuple[int, ...] = ()  # elastic jobs: each rank's pid, from the launcher (0: unknown)

    def host_of_rank(self, r: int) -> int:
        return self.host_of[r] if self.host_of else 0


def host_identity() -> str:
    """Host name plus the kernel's boot id: two containers with the same host name on different
    machines differ, two processes on one machine agree. FASTXFER_HOST_ID overrides it (for
    containers that share a boot id across machines, and for tests that emulate several hosts)."""
    override = config.get("FASTXFER_HOST_ID")
    if override:
        return f"override/{override}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def host_timeout() -> float:
    """FASTXFER_HOST_TIMEOUT (seconds, default 5): across hosts, every rank exchanges UDP heartbeats
    with its counterparts on the other hosts, and one not heard from for this long is lost: every
    collective waiting on the network raises PeerFailureError naming its host, instead of blocking
    until TCP gives up (minutes). 0 turns heartbeats off (docs/multihost.md, "A link that goes down")."""
    return config.get("FASTXFER_HOST_TIMEOUT")


def net_chunk_bytes() -> int:
    """FASTXFER_NET_CHUNK_MB (default 1): across hosts, allreduce chunks of at most this many MB on
    the wire, each one's network stage (on a thread of its own) overlapped with the next one's
    shared-memory stages; 0 turns the overlap off (one network call per half window, on the
    engine thread). Measured on simulated hosts: 20-28% faster where the link is the bottleneck
    (2x2 on a 1 Gbit/s link), the same within noise where the CPU is (docs/algorithms.md)."""
    return int(config.get("FASTXFER_NET_CHUNK_MB") * (1 << 20))


def _mpi_rendezvous(rank: int, size: int | None, source: str) -> Layout:
    """The job through mpi4py's COMM_WORLD (the launcher wired MPI); `size` None: MPI's own."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise FastxferError(
            f"this process was started by {source} as rank {rank} of {size or 'several'}, and finding the other ranks "
            "then needs mpi4py: pip install 'fastxfer[mpi]' (or start the job with `fastxfer run -np N`)"
        ) from None
    comm = MPI.COMM_WORLD
    if size is None:
        size = comm.Get_size()
    if comm.Get_size() != size or comm.Get_rank() != rank:
        raise FastxferError(f"{source} says rank {rank} of {size} but MPI says rank {comm.Get_rank()} of "
                            f"{comm.Get_size()}")
    ids = comm.allgather((host_identity(), os.getpid()))
    hosts = [h for h, _ in ids]
    order = list(dict.fromkeys(hosts))  # hosts in order of their lowest rank
    counts = [hosts.count(h) for h in order]
    if len(set(counts)) > 1:
        raise FastxferError(f"hosts run different numbers of ranks ({', '.join(map(str, counts))}); fastxfer's "
                            "hierarchical allreduce needs the same number on every host")
    mine = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    host_index = order.index(hosts[rank])
    token = comm.bcast(secrets.token_hex(16) if rank == 0 else None, root=0)
    # The name starts with the pid of the host's first rank (the segment's creator, alive while the
    # job runs), so `fastxfer run`'s sweep of dead launchers' segments can check it on this host.
    creator_pid = ids[mine[0]][1]
    inter = None
    if len(order) > 1:
        inter = MPIInterHost(comm, mine.index(rank), host_index)
    name = segments.random_segment_name(creator_pid, token, f"-h{host_index}")
    offset = clock_offset(comm, rank, size) if len(order) > 1 else 0.0
    return Layout(rank, size, mine.index(rank), len(mine), segments.path(name), source, len(order), inter,
                  tuple(order.index(h) for h in hosts), comm, clock_offset_us=offset)


def clock_offset(comm, rank: int, size: int, rounds: int = 8) -> float:
    """Rank 0's steady clock minus this rank's, in microseconds, from `rounds` ping-pongs with rank 0
    over MPI (the one with the shortest round trip counts): the timeline's common clock across hosts."""
    if rank == 0:
        for r in range(1, size):
            for _ in range(rounds):
                comm.recv(source=r, tag=0x7F1)
                comm.send(time.monotonic_ns() / 1e3, dest=r, tag=0x7F2)
        return 0.0
    best = None
    for _ in range(rounds):
        t1 = time.monotonic_ns() / 1e3
        comm.send(None, dest=0, tag=0x7F1)
        t0 = comm.recv(source=0, tag=0x7F2)
        t2 = time.monotonic_ns() / 1e3
        if best is None or t2 - t1 < best[0]:
            best = (t2 - t1, t0 - (t1 + t2) / 2)
    return best[1]


def _launcher_of(job: str) -> int:
    try:
        return int(job.split("-", 1)[0])
    except ValueError:
        raise FastxferError(f"FASTXFER_JOB_ID={job!r} does not start with the launcher's pid") from None


def _elastic_layout() -> Layout:
    """An elastic job's layout: the launcher's rendezvous assigns rank, size and generation; the
    generation picks the segment name (one host)."""
    job = config.get("FASTXFER_JOB_ID")
    secret = config.get("FASTXFER_JOB_SECRET")
    if not job or not secret:
        raise FastxferError("an elastic worker needs FASTXFER_JOB_ID and FASTXFER_JOB_SECRET (set by `fastxfer run "
                            "--min-np`)")
    m = rendezvous.join()
    name = segments.job_segment_name(_launcher_of(job), job, secret, int(m["generation"]))
    rank, size = int(m["rank"]), int(m["size"])
    pids = m.get("pids")
    pids = tuple(int(p) for p in pids) if isinstance(pids, list) and len(pids) == size else ()
    return Layout(rank, size, rank, size, segments.path(name), "fastxfer run (elastic)",
                  generation=int(m["generation"]), member_pids=pids)


def detect_layout(generation: int = 0) -> Layout:
    """The layout from the launcher's environment (see the table above); FastxferError when it is inconsistent.

    ``generation`` counts this process's init()s; under `fastxfer run` it picks the segment name
    (every rank of a host counts the same, so they agree on it without talking)."""
    if rendezvous.is_elastic():
        return _elastic_layout()
    if config.is_set("FASTXFER_RANK") or config.is_set("FASTXFER_SIZE"):
        rank, size = config.get("FASTXFER_RANK"), config.get("FASTXFER_SIZE")
        job = config.get("FASTXFER_JOB_ID")
        secret = config.get("FASTXFER_JOB_SECRET")  # SettingError when too short to be unguessable
        if rank is None or size is None or not job or not secret:
            raise FastxferError("FASTXFER_RANK, FASTXFER_SIZE, FASTXFER_JOB_ID and FASTXFER_JOB_SECRET must all be "
                                "set (by `fastxfer run`)")
        if not 0 <= rank < size:
            raise FastxferError(f"FASTXFER_RANK={rank} is outside 0..{size - 1}")
        launcher = _launcher_of(job)
        local_rank = config.get("FASTXFER_LOCAL_RANK")
        local_size = config.get("FASTXFER_LOCAL_SIZE")
        name = segments.job_segment_name(launcher, job, secret, generation)
        return Layout(rank, size, rank if local_rank is None else local_rank, size if local_size is None else local_size,
                      segments.path(name), "fastxfer run")
    announced = launchers.detect()
    if announced is not None and announced.size != 1:
        return _launcher_layout(announced, generation)
    source = "single process" if announced is None else f"{announced.launcher}, 1 rank"
    return Layout(0, 1, 0, 1, segments.path(segments.random_segment_name(os.getpid(), secrets.token_hex(16))),
                  source)


def _launcher_layout(a: launchers.Announcement, generation: int) -> Layout:
    """The job another launcher announced (comm/launchers.py): through MPI where the launcher wired it
    and the job needs it, else the ranks of this host meet without MPI (comm/host_rendezvous.py).
    Never a process alone: a job that cannot form is an error naming the launcher and the fix."""
    if a.mpi and not (a.launcher.startswith("Slurm") and a.one_host):
        return _mpi_rendezvous(a.rank, a.size or None, a.launcher)
    if not a.one_host:
        hosts = f" over {a.nodes} hosts" if a.nodes else " over several hosts"
        raise FastxferError(
            f"{a.describe()}{hosts}. fastxfer joins hosts through MPI, which {a.launcher} does not wire, so this "
            f"job cannot form (and no rank trains alone). Launch it with one of: {launchers.MPI_LINES}")
    met = host_rendezvous.meet(launcher=a.launcher, key=a.key, generation=generation, rank=a.rank, size=a.size,
                               host=host_identity(), timeout=config.get("FASTXFER_ATTACH_TIMEOUT"))
    name = segments.random_segment_name(int(met["creator"]), str(met["token"]))
    # one host: the job's ranks are the host's, in the same order (collectives order by them)
    return Layout(a.rank, a.size, a.rank, a.size, segments.path(name), a.launcher)


_lock = threading.RLock()
_engine: _core.Engine | None = None
_layout: Layout | None = None
_generation = 0  # init()s so far in this process: picks the next segment name (comm/segments.py)
_shutdown_hooks: list[Callable[[], None]] = []
_before_shutdown: list[Callable[[], None]] = []
_after_init: list[Callable[[list], None]] = []  # init(process_sets=...): comm/set_registration.py
_engine_started: list[Callable[[], None]] = []  # right after init() started the engine (comm/timeline.py)
_at_exit: list[Callable[[], None]] = []  # before the exit-time shutdown (comm/process_sets.py)
_init_args: dict = {}  # the last init()'s keyword arguments: an elastic reset joins again with them
_settings: dict = {}  # init()'s engine settings, for the engines of process sets (comm/process_sets.py)


def on_shutdown(callback: Callable[[], None]) -> Callable[[], None]:
    """Have ``callback()`` called at the end of every shutdown(), after the engine has stopped.

    Modules built on the group register here to drop their per-job state (automatic request
    names, buffers the engine may still have held), so that the next init() starts afresh; the
    group itself knows nothing of them. Returns ``callback`` (usable as a decorator)."""
    with _lock:
        _shutdown_hooks.append(callback)
    return callback


def on_engine_started(callback: Callable[[], None]) -> Callable[[], None]:
    """Registers `callback` to run on every rank right after init() started the engine."""
    _engine_started.append(callback)
    return callback


def before_shutdown(callback: Callable[[], None]) -> Callable[[], None]:
    """Have ``callback()`` called at the start of every shutdown(), while the engine still runs
    (process sets stop their own engines here). Returns ``callback``."""
    with _lock:
        _before_shutdown.append(callback)
    return callback


def after_init(callback: Callable[[list], None]) -> Callable[[list], None]:
    """Have ``callback(process_sets)`` called at the end of init(process_sets=[...]) (process sets
    register themselves there). Returns ``callback``."""
    with _lock:
        _after_init.append(callback)
    return callback


def at_exit(callback: Callable[[], None]) -> Callable[[], None]:
    """Have ``callback()`` called at interpreter exit, before the exit-time shutdown (process sets
    leave there without waiting for their peers). Returns ``callback``."""
    with _lock:
        _at_exit.append(callback)
    return callback


def keep_in_fork_child(engine) -> None:
    """In a forked child: keep a parent's engine object alive and unused (see _after_fork_in_child)."""
    _parents_engines.append(engine)


def timeline_path(rank: int) -> str:
    """Where a process set's engine writes this rank's own timeline (comm/set_registration.py): beside
    FASTXFER_TIMELINE, the rank before the extension (timeline.json -> timeline.1.json); "" when
    unset. The job's own timeline is one file (comm/timeline.py)."""
    path = config.get("FASTXFER_TIMELINE")
    if not path or rank == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.{rank}{ext}"


def spin_us() -> float:
    """FASTXFER_SPIN_US: how long a wait for a peer spins before it sleeps (default 50 us,
    chosen by measurement: docs/architecture.md); 0 sleeps at once."""
    return config.get("FASTXFER_SPIN_US")


def mark(name: str) -> None:
    """A step mark on the timeline (FASTXFER_TIMELINE); does nothing without a timeline."""
    eng = _engine
    if eng is not None and eng.timeline_enabled:
        eng.mark(name)


def init(comm=None, process_sets=None, *, timeout: float | None = None, engine_cpus: list[int] | str | None = None,
         bucket_cap_mb: float | None = None) -> None:
    """Join the job. Calling it again while initialised does nothing.

    ``process_sets`` (Horovod's): ProcessSet objects (or lists of ranks) to register right away,
    in order, as add_process_set does; ``"dynamic"`` is accepted (sets can always be added later).
    ``comm`` (Horovod's): None or MPI.COMM_WORLD -- fastxfer's job is always every launched rank.
    Every FASTXFER_* setting that is set is checked first (fastxfer.settings; docs/configuration.md):
    a bad value is one SettingError naming it.
    ``timeout`` (s, default FASTXFER_TIMEOUT or 300): how long a peer may stay silent before the
    others raise PeerFailureError (a peer that dies is noticed within a fraction of a second).
    ``engine_cpus``: pin the engine thread (default FASTXFER_ENGINE_CPUS, else unpinned).
    ``bucket_cap_mb``: the fusion bucket cap (default FASTXFER_BUCKET_CAP_MB, else 25).
    """
    global _engine, _layout, _generation
    config.validate_all()
    fxlog.configure()
    _warn_horovod_variables()
    if comm is not None and not _is_comm_world(comm):
        raise NotImplementedError("init(comm=...): fastxfer's job is every rank the launcher started; pass the "
                                  "subset as a process set instead (init(process_sets=[ProcessSet(ranks)]))")
    if process_sets is not None and not isinstance(process_sets, str):
        process_sets = list(process_sets)
    elif isinstance(process_sets, str) and process_sets != "dynamic":
        raise ValueError(f"process_sets must be a list of process sets or 'dynamic', not {process_sets!r}")
    with _lock:
        if _engine is not None:
            return
        if _forked_from is not None:
            raise _forked_error()
        _init_args.clear()
        _init_args.update(timeout=timeout, engine_cpus=engine_cpus, bucket_cap_mb=bucket_cap_mb)
        generation = _generation
        _generation += 1  # every init() that gets this far, failed ones too: all ranks count alike
        layout = detect_layout(generation)
        window = int(config.get("FASTXFER_SHM_WINDOW_MB") * (1 << 20))
        oob = int(config.get("FASTXFER_OOB_KB") * 1024)
        cap = check.bucket_cap_bytes(config.get("FASTXFER_BUCKET_CAP_MB") if bucket_cap_mb is None else bucket_cap_mb)
        if timeout is None:
            timeout = config.get("FASTXFER_TIMEOUT")
        if not timeout > 0:  # NaN too
            raise ValueError(f"timeout must be positive, got {timeout}")
        threads = config.get("FASTXFER_ENGINE_THREADS")
        if engine_cpus is None:
            engine_cpus = config.get("FASTXFER_ENGINE_CPUS") or []
        cpus = (topology.parse_cpu_list(engine_cpus) if isinstance(engine_cpus, str)
                else sorted(set(int(c) for c in engine_cpus)))
        allowed = os.sched_getaffinity(0)
        if any(c not in allowed for c in cpus):
            raise ValueError(f"engine_cpus {cpus} are not all in this process's CPU set {sorted(allowed)}")
        stream_min = int(config.get("FASTXFER_STREAM_MIN_MB") * (1 << 20))
        stall_warning = config.get("FASTXFER_STALL_WARNING_S")
        topology.apply_thread_settings()  # TensorFlow's thread counts from `fastxfer run --bind`, if loaded
        settings = dict(window=window, oob=oob, timeout=float(timeout),
                        attach_timeout=config.get("FASTXFER_ATTACH_TIMEOUT"), threads=threads, cpus=cpus, cap=cap,
                        stream_min=stream_min, spin_us=spin_us(), spin_max_us=config.get("FASTXFER_SPIN_MAX_US"),
                        stall_warning=min(60.0, timeout / 2) if stall_warning is None else stall_warning,
                        report_dir=config.get("FASTXFER_REPORT_DIR") or "",
                        net_chunk=net_chunk_bytes(), host_timeout=host_timeout(),
                        yield_on_wake=config.get("FASTXFER_YIELD"), host_id=config.get("FASTXFER_HOST_ID") or "",
                        eager=int(config.get("FASTXFER_EAGER_KB") * 1024), eager_tune=config.get("FASTXFER_EAGER_TUNE"),
                        host_leader=config.get("FASTXFER_HOST_LEADER"))
        here = layout.host_of_rank(layout.rank)
        on_host = [r for r in range(layout.size) if layout.host_of_rank(r) == here] if layout.host_of else []
        settings["clock_offset_us"] = layout.clock_offset_us
        while True:
            try:
                _engine = make_engine(settings, layout.segment, layout.local_rank, layout.local_size,
                                      layout.inter_host, "", layout.rank, on_host, member_pids=layout.member_pids)
                break
            except PeerFailureError as e:
                if not layout.member_pids:
                    raise
                # elastic: a member died before the group could start (the launcher re-forms
                # without it): join the next generation, as a worker whose peer failed later would
                log.warning("generation %d did not start (%s); joining the next one", layout.generation, e)
                layout = _elastic_layout()
                here = layout.host_of_rank(layout.rank)
        _engine.make_current()  # what the native TensorFlow ops submit to (engine/c_api.h)
        _layout = layout
        fxlog.set_rank(layout.rank)
        log.info("rank %d of %d (local rank %d of %d, %d host(s)), started by %s", layout.rank, layout.size,
                 layout.local_rank, layout.local_size, layout.hosts, layout.source)
        for callback in list(_engine_started):
            callback()  # the timeline (comm/timeline.py), when FASTXFER_TIMELINE names one
        _settings.clear()
        _settings.update(settings)
    if isinstance(process_sets, list) and process_sets:
        for callback in list(_after_init):
            callback(process_sets)


log = fxlog.logger
_warned_horovod = False


def _warn_horovod_variables() -> None:
    """One warning naming every HOROVOD_* variable that is set and changes nothing here (once per process)."""
    global _warned_horovod
    lines = horovod_settings.no_effect()
    if lines and not _warned_horovod:
        _warned_horovod = True
        warnings.warn("Horovod settings that change nothing in fastxfer (docs/configuration.md):\n  " +
                      "\n  ".join(lines), HorovodSettingWarning, stacklevel=3)


class HorovodSettingWarning(UserWarning):
    """A HOROVOD_* variable is set that has no meaning in fastxfer (named with the reason)."""


def init_args() -> dict:
    """The keyword arguments of the last init() (timeout, engine_cpus, bucket_cap_mb)."""
    return dict(_init_args)


def _is_comm_world(comm) -> bool:
    try:
        from mpi4py import MPI
    except ImportError:
        return False
    return comm == MPI.COMM_WORLD or (isinstance(comm, MPI.Comm) and
                                      MPI.Comm.Compare(comm, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT))


MAX_RECORDS = 1024  # request descriptors one negotiation round carries (a segment's size depends on it)


def make_engine(settings: dict, segment: str, local_rank: int, local_size: int, inter_host, timeline: str,
                rank: int, segment_ranks=(), job_ranks=(), member_pids=(), precreated: bool = False) -> _core.Engine:
    """An engine over `segment` with init()'s settings: the job's, or a process set's.
    ``segment_ranks``/``job_ranks``: the job rank of each rank of the segment / of the engine,
    so that its messages name ranks as the user knows them (empty: the same numbers). ``precreated``:
    this rank (the segment's first) made the segment with _core.precreate_segment."""
    s = settings
    # The adaptive spin (FASTXFER_SPIN_MAX_US) only where every rank of the job on this machine is
    # in the segment and has a core: a longer spin takes the core a peer needs when ranks share
    # cores (2 simulated hosts x 2 ranks on 2 cores: 4 KiB 0.14 -> 0.70 ms; docs/architecture.md).
    spin_max = s.get("spin_max_us", 1000.0)
    if inter_host is not None or local_size > (os.cpu_count() or 1):
        spin_max = 0.0
    return _core.Engine(segment, local_rank, local_size, s["window"], s["oob"], s["timeout"], s["attach_timeout"],
                        s["threads"], s["cpus"], s["cap"], MAX_RECORDS, s["stream_min"], inter_host, timeline, rank,
                        s["spin_us"], s["stall_warning"], s["report_dir"], list(segment_ranks), list(job_ranks),
                        s.get("net_chunk", 1 << 20), s.get("host_timeout", 0.0), s.get("yield_on_wake", True),
                        s.get("host_id", ""), s.get("clock_offset_us", 0.0), s.get("timeline_mark_cycles", False),
                        list(member_pids), precreated, s.get("eager", 32 << 10), s.get("host_leader", True),
                        s.get("eager_tune", True), spin_max)


def settings() -> dict:
    """The engine settings init() chose (window, timeouts, CPUs, bucket cap, ...)."""
    _current()
    return dict(_settings)


def shutdown() -> None:
    """Leave the job. Collective: returns once every rank has called it (or failed)."""
    global _engine, _layout
    with _lock:
        eng = _engine
        if eng is None:
            return
        try:
            for callback in list(_before_shutdown):
                callback()
            eng.shutdown()
        finally:
            _core.clear_current_engine()
            _engine = None
            _layout = None
            for callback in list(_shutdown_hooks):
                callback()


def _forget_engine() -> None:
    """After a non-collective leave: no engine, as after shutdown()."""
    global _engine, _layout
    with _lock:
        _engine = None
        _layout = None
        for callback in list(_shutdown_hooks):
            callback()


_uncaught: list[str] = []  # the exception that is ending the interpreter, if one is


def _note_uncaught(exc_type, exc, tb) -> None:
    if not _uncaught:
        _uncaught.append(f"{exc_type.__name__}: {exc}".splitlines()[0][:300])
    _previous_excepthook(exc_type, exc, tb)


_previous_excepthook = sys.excepthook
sys.excepthook = _note_uncaught


def _atexit_shutdown() -> None:
    # At interpreter exit, leave quietly: an error here would only hide the real one. Process
    # sets leave first, without waiting for their peers: a rank that exits (after an exception,
    # say) while a peer waits for it in another engine would otherwise wait for that peer in turn.
    # A process ending with an uncaught exception leaves the global engine the same way (not
    # collective): waiting there for peers that still compute would hold the failing rank up to
    # FASTXFER_TIMEOUT, and the peers learn of it at once (PeerFailureError naming the error).
    eng = _engine
    hosts = _layout.hosts if _layout is not None else 1
    failed = bool(_uncaught)
    try:
        for callback in list(_at_exit):
            callback()
        if _uncaught and eng is not None:
            try:
                eng.leave(f"the process ended with {_uncaught[0]}")
            finally:
                _core.clear_current_engine()
                _forget_engine()
        else:
            shutdown()
    except Exception:
        failed = True
    if eng is not None and (eng.host_lost or (failed and hosts > 1)):
        # A host was lost: an MPI call may still be blocked on it (on a thread of the engine's), and
        # MPI_Finalize (mpi4py's, after this) would wait for the lost host forever. Leave now. The
        # same after any failure in a job across hosts: this rank may have failed because a local
        # peer left on losing a host before its own heartbeats told it so.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(1)


atexit.register(_atexit_shutdown)

_forked_from: int | None = None  # the parent's pid, in a forked child of an initialised process
_parents_engines: list = []      # the parent's engine objects, kept (never used, never destroyed)


def _after_fork_in_child() -> None:
    # A forked child must not run the parent's engine: its thread does not exist here, its shared
    # memory is the parent's, and a collective would wait forever. Keep the layout (rank() and
    # size() still say where the parent sits, which data-loader workers use for sharding), drop
    # the engine so the exit handler does not run a collective shutdown, and make every
    # collective fail with an error that says why. The C++ engine refuses a child too
    # (engine.cc, check_process) and leaks itself rather than touch the parent's job.
    global _engine, _lock, _forked_from
    _lock = threading.RLock()  # the parent's may have been held by another thread at fork time
    if _engine is not None:
        _parents_engines.append(_engine)
        _engine = None
        _forked_from = os.getppid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def is_initialized() -> bool:
    """Whether init() has run (and shutdown() has not since)."""
    return _engine is not None


def _forked_error() -> FastxferError:
    return FastxferError(
        f"fastxfer was initialised in process {_forked_from}, and this process is a fork of it: a forked "
        "child cannot take part in the parent's collectives. Run them in the parent, or start the child "
        "with the 'spawn' start method (multiprocessing.get_context('spawn')) and call fastxfer.init() "
        "there as a rank of a job of its own")


def _current() -> tuple[_core.Engine, Layout]:
    eng, layout = _engine, _layout
    if eng is None or layout is None:
        if _forked_from is not None:
            raise _forked_error()
        raise FastxferError("fastxfer is not initialised: call fastxfer.init() first")
    return eng, layout


def _current_layout() -> Layout:
    # A forked child still knows where its parent sits in the job (data-loader workers shard by it).
    layout = _layout
    if layout is not None and (_engine is not None or _forked_from is not None):
        return layout
    return _current()[1]


def engine() -> _core.Engine:
    """The running engine (what the collectives submit to); FastxferError before init()."""
    return _current()[0]


def rank() -> int:
    """This process's rank in the job (0 .. size()-1)."""
    return _current_layout().rank


def size() -> int:
    """Number of processes in the job."""
    return _current_layout().size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return _current_layout().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return _current_layout().local_size


# what engine_stats() reports, in the native CommStats' names
STATS_KEYS = ("pack_s", "wait_s", "reduce_s", "unpack_s", "negotiate_s", "chunks", "rounds", "wire_bytes",
              "eager_buckets")


def engine_stats() -> dict:
    """Cumulative seconds the engine spent packing, waiting for peers, reducing, unpacking and
    negotiating, with chunk/round counts and the buckets that travelled with the records
    (``eager_buckets``): where the communication time goes. ``eager_tuning``: what this rank's
    engine measured of the two paths for small allreduces, one dict per size class
    (docs/algorithms.md, "Which path, measured")."""
    engine = _current()[0]
    s = engine.stats()
    return {**{k: getattr(s, k) for k in STATS_KEYS}, "eager_tuning": engine.eager_tuning()}


def hosts() -> int:
    """Number of hosts the job spans."""
    return _current_layout().hosts


def layout() -> Layout:
    """Where this process sits in the job: ranks, hosts, the shared-memory segment, the launcher."""
    return _current_layout()
