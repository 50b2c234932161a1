"""Process sets: collectives among a subset of the ranks (Horovod's ``ProcessSet``).

A process set is a sorted list of ranks. Registering one (``add_process_set``) is collective:
every rank of the job calls it, with the same ranks, in the same order as the other
registrations -- the ranks compare what they were given, and a disagreement is a MismatchError
on every rank naming what each rank passed. The ranks of the set then start an engine of their
own for it: its own shared-memory segment on each host (the job's segment name plus
``-s<id>-<128 random bits>``, which the set's first rank there creates before any member waits
for it: owner-only like the job's, unguessable even to a user who sees the job's name in
/dev/shm, and swept with the job's; comm/set_registration.py), its own
negotiation, its own engine thread, and -- when the set spans hosts -- an MPI communicator of its
members. Collectives on different sets therefore run concurrently and cannot mix up their
order; inside a set, the usual rules hold (same collectives, same order, names and shapes
checked, a dead peer noticed within a second).

Ranks inside a set: results come in the order of the set's ranks (an allgather concatenates
them in that order), a broadcast's root is a rank of the job that is in the set (as in Horovod),
an average divides by the set's size, an alltoall's splits have one entry per rank of the set.

A set costs one engine thread per member (asleep unless the set is used) and a segment per host
of 4 KiB + k x (1.38 MiB + FASTXFER_SHM_WINDOW_MB) for k members there. ``remove_process_set``
(collective again) stops it and frees that memory; ``shutdown()`` stops every set first.

Horovod's rules, and where fastxfer differs:

- A collective on a set this rank is not in raises NotInProcessSetError (in fastxfer.tensorflow
  also a tf.errors.InvalidArgumentError); DistributedGradientTape and DistributedOptimizer on such
  a rank return its gradients as they are (Horovod's ``_allreduce_cond``).
- Registering a set with the same ranks as a registered one is a ValueError; so is removing the
  global set (Horovod's remove_process_set returns False there: a call that cannot do what it
  says is an error in fastxfer) and removing a set twice (Horovod trips an assert).
- A collective on a removed set raises ProcessSetRemovedError (a ValueError) naming its id.
- Ids: the global set is 0, then 1, 2, ... . Horovod hands a removed set's id to the next set
  registered; fastxfer never reuses an id within a job (``shutdown()`` starts again from 1). A
  ``tf.function`` traced on a set keeps the set's id in its ops: with reuse it would silently run
  on whatever set got the id next (other ranks, another size for its averages); with fresh ids it
  fails, naming the id.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from fastxfer import _core
from fastxfer.comm import group
from fastxfer.errors import NotInProcessSetError, ProcessSetRemovedError

_lock = threading.RLock()


class ProcessSet:
    """A subset of the job's ranks that runs collectives of its own.

    ``ProcessSet(ranks)`` describes one (ranks: an iterable of distinct ints, or an mpi4py
    communicator whose ranks are taken); it is usable once registered with ``add_process_set``
    (or ``fastxfer.keras.init(process_sets=[...])``), which gives it ``process_set_id``.
    ``global_process_set`` (id 0) is every rank."""

    def __init__(self, ranks_or_comm=None):
        self.process_set_id: int | None = None
        self.mpi_comm = None
        self._engine: _core.Engine | None = None
        self._ranks: list[int] | None = None
        self._removed: int | None = None  # the id it had, once remove_process_set removed it
        if ranks_or_comm is None:
            return
        if hasattr(ranks_or_comm, "Get_group") and hasattr(ranks_or_comm, "Get_size"):
            self.mpi_comm = ranks_or_comm
            return  # its ranks are known once the job's communicator is (add_process_set)
        self._ranks = normalise(ranks_or_comm)

    @property
    def ranks(self) -> list[int]:
        """The job ranks in this set, ascending (every rank for the global set)."""
        if self._ranks is None:
            if self.process_set_id == 0:
                return list(range(group.size()))
            if self.mpi_comm is not None:
                return comm_ranks(self.mpi_comm)
            return []
        return list(self._ranks)

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self.ranks)

    def included(self) -> bool:
        """Whether this process is one of the set's ranks."""
        return group.rank() in self.ranks

    def rank(self) -> int | None:
        """This process's position among the set's ranks (0 .. size()-1), None when not included."""
        r = group.rank()
        ranks = self.ranks
        return ranks.index(r) if r in ranks else None

    @property
    def removed_id(self) -> int | None:
        """The id it had, once remove_process_set removed it (None otherwise)."""
        return self._removed

    def invalidate(self) -> None:
        """Forget the registration (remove_process_set, shutdown)."""
        self.process_set_id = None
        self._engine = None

    def set_ranks(self, ranks) -> None:
        """Fix the ranks (an mpi4py communicator's, known once the job is)."""
        self._ranks = normalise(ranks)

    def set_engine(self, engine) -> None:
        """The engine this rank runs the set's collectives on (registration does this)."""
        self._engine = engine
        if engine is not None:
            engine.make_process_set_engine(self.process_set_id)

    def __eq__(self, other):
        if not isinstance(other, ProcessSet):
            return NotImplemented
        return self.process_set_id == other.process_set_id and self.ranks == other.ranks

    def __hash__(self):
        return hash(self.process_set_id)

    def __repr__(self):
        # Horovod's form; the global set's ranks are every rank once the job is known ([] before)
        ranks = self._ranks
        if self.process_set_id == 0:
            ranks = list(range(group.size())) if group.is_initialized() else []
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks}, mpi_comm={self.mpi_comm})"

    __str__ = __repr__


global_process_set = ProcessSet()
global_process_set.process_set_id = 0

_sets: dict[int, ProcessSet] = {}  # registered sets other than the global one, by id
_next_id = 1


def normalise(ranks) -> list[int]:
    try:
        items = list(ranks)
    except TypeError:
        raise TypeError(f"a process set's ranks must be a list of ints, not {type(ranks).__name__}") from None
    out = []
    for r in items:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
            raise TypeError(f"a process set's ranks must be ints, not {r!r}")
        out.append(int(r))
    if not out:
        raise ValueError("a process set needs at least one rank")
    if len(set(out)) != len(out):
        raise ValueError(f"a process set's ranks must be distinct, got {items}")
    return sorted(out)


def comm_ranks(comm) -> list[int]:
    from mpi4py import MPI

    mine = comm.Get_group()
    world = MPI.COMM_WORLD.Get_group()
    return sorted(MPI.Group.Translate_ranks(mine, list(range(mine.Get_size())), world))


def stop(ps: ProcessSet) -> None:
    """Stop a registered set's engine on this rank (collective among its ranks) and forget it."""
    eng = ps._engine
    pid = ps.process_set_id
    ps.invalidate()
    if eng is not None:
        _core.clear_process_set_engine(pid)
        eng.shutdown()


@group.before_shutdown
def _stop_all() -> None:
    global _next_id
    with _lock:
        errors = []
        for pid in sorted(_sets):
            try:
                stop(_sets[pid])
            except Exception as e:  # the job's shutdown still runs; the first error is raised after it
                errors.append(e)
        _sets.clear()
        _next_id = 1
    if errors:
        raise errors[0]


def _leave_all() -> None:
    # Interpreter exit without shutdown(): stop every set's engine without its peers (Engine.leave).
    # A peer still waiting for this rank in a set fails at once ("... left without calling
    # shutdown()") instead of waiting for it while this rank waits in the job's exit-time shutdown.
    global _next_id
    with _lock:
        for pid in sorted(_sets):
            ps = _sets[pid]
            eng = ps._engine
            ps.invalidate()
            if eng is not None:
                _core.clear_process_set_engine(pid)
                eng.leave("the process left without calling shutdown()")
        _sets.clear()
        _next_id = 1


group.at_exit(_leave_all)


def resolve(process_set, members_only: bool = True) -> ProcessSet | None:
    """The registered set a collective runs on: None for the global set (or process_set=None).
    Raises ProcessSetRemovedError (a ValueError) for a removed set, ValueError for one that is not
    registered, and NotInProcessSetError when this rank is not in it -- unless ``not members_only``
    (a gradient reduction, which leaves such a rank's gradients alone): then the set is returned."""
    if process_set is None or process_set is global_process_set:
        return None
    group.engine()  # not initialised, or a forked child: that error first
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, not {type(process_set).__name__}")
    pid = process_set.process_set_id
    if pid == 0:
        return None
    if pid is None and process_set._removed is not None:
        raise removed_error(process_set)
    if pid is None or _sets.get(pid) is not process_set:
        raise ValueError(f"{process_set!r} is not registered: call add_process_set first (on every rank)")
    if process_set._engine is None and members_only:
        raise NotInProcessSetError(f"rank {group.rank()} is not in {process_set!r}: only its ranks may run its "
                                   "collectives (ask process_set.included() before calling)")
    return process_set


def removed_error(ps: ProcessSet) -> ProcessSetRemovedError:
    return ProcessSetRemovedError(f"process set {ps._removed} (ranks {ps.ranks}) was removed by remove_process_set: "
                                  "its collectives can no longer run; register the ranks again with add_process_set "
                                  "(on every rank) and use the set it returns")


def by_id(process_set_id: int) -> ProcessSet:
    """The registered set with this id (0: the global set); ValueError when there is none."""
    if process_set_id == 0:
        return global_process_set
    ps = _sets.get(process_set_id)
    if ps is None:
        raise ValueError(f"no process set with id {process_set_id} is registered")
    return ps


def engine_of(ps: ProcessSet | None) -> _core.Engine:
    """The engine a collective on `ps` (from resolve) submits to."""
    if ps is None:
        return group.engine()
    eng = ps._engine
    if eng is None:  # removed meanwhile
        if ps._removed is not None:
            raise removed_error(ps)
        raise ValueError(f"{ps!r} is not registered")
    return eng


def lock() -> threading.RLock:
    """The registry's lock (set_registration holds it through a registration)."""
    return _lock


def next_id() -> int:
    """The id the next registration gets (the same on every rank that made the same calls)."""
    return _next_id


def find(ranks: list[int]) -> ProcessSet | None:
    """The registered set with exactly these ranks, if any."""
    return next((ps for ps in _sets.values() if ps.ranks == ranks), None)


def record(ps: ProcessSet, engine) -> None:
    """Register `ps` under id next_id(), with its engine on this rank (None: not a member)."""
    global _next_id
    with _lock:
        ps.process_set_id = _next_id
        ps._removed = None
        ps.set_engine(engine)
        _sets[_next_id] = ps
        _next_id += 1


def is_registered(ps: ProcessSet) -> bool:
    return ps.process_set_id is not None and _sets.get(ps.process_set_id) is ps


def forget(ps: ProcessSet) -> None:
    """Stop `ps` (stop()) and drop it from the registry (remove_process_set): later collectives on
    it raise ProcessSetRemovedError naming the id it had."""
    with _lock:
        pid = ps.process_set_id
        ps._removed = pid
        try:
            stop(ps)  # its engine is stopped even when this raises (a peer that left, a request in flight)
        finally:
            _sets.pop(pid, None)


def _after_fork_in_child() -> None:
    # The parent's set engines belong to the parent (see group._after_fork_in_child).
    global _lock
    _lock = threading.RLock()
    for ps in _sets.values():
        if ps._engine is not None:
            group.keep_in_fork_child(ps._engine)
            ps._engine = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
