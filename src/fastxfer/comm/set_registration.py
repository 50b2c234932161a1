"""Registering and removing process sets: ``add_process_set``, ``remove_process_set`` and
``init(process_sets=...)``. Both calls are collective on every rank of the job; the ranks first
agree, over the job's engine, that they were given the same set (comm/process_sets.py has the
model; docs/architecture.md, "Process sets", the design)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets

import numpy as np

from fastxfer import _core
from fastxfer.comm import collectives, group, process_sets
from fastxfer.comm.process_sets import ProcessSet
from fastxfer.errors import FastxferError, MismatchError, ProcessSetRemovedError


def _digest(words: list[int]) -> np.ndarray:
    h = hashlib.sha256(",".join(map(str, words)).encode()).digest()
    return np.frombuffer(h, np.int64).copy()


def _agree(what: str, words: list[int], describe) -> None:
    """Every rank of the job checks that all ranks passed the same `words` (a fixed-size digest
    goes round first; the full lists only when they differ, to name who passed what)."""
    d = _digest(words)
    every = collectives.allgather(d[None, :], name=f"process_sets.{what}").reshape(group.size(), -1)
    if all((row == every[0]).all() for row in every):
        return
    lists = collectives.allgather_object(words, name=f"process_sets.{what}.detail")
    per = "; ".join(f"rank {r}: {describe(w)}" for r, w in enumerate(lists))
    raise MismatchError(f"{what}: the ranks disagree ({per}); every rank must make the same process set calls, in "
                        "the same order")


def _agree_on_partition(pid: int, ranks: list[int]) -> list[list[int]]:
    """ProcessSet(mpi_comm): each rank's communicator may hold other ranks (Horovod's split form:
    the even ranks' set and the odd ranks' set registered as one id). Every rank must be in its own
    list and every member of a list must hold the same list; returns the lists (a partition of the
    ranks that registered a communicator)."""
    lists = collectives.allgather_object([pid] + ranks, name="process_sets.add_process_set.comm")
    ok = all(w[0] == lists[0][0] for w in lists)
    for r, w in enumerate(lists):
        ok = ok and r in w[1:] and all(lists[m][1:] == w[1:] for m in w[1:])
    if not ok:
        per = "; ".join(f"rank {r}: id {w[0]}, ranks {w[1:]}" for r, w in enumerate(lists))
        raise MismatchError(f"add_process_set: the ranks' communicators do not split the job into groups ({per}); "
                            "each rank's communicator must hold that rank, and every rank in it the same one")
    return [list(g) for g in dict.fromkeys(tuple(w[1:]) for w in lists)]


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ProcessSet, or a list of ranks) and return it, with its id.
    Collective: every rank of the job calls it with the same ranks, in the same order as its other
    add/remove_process_set calls. Raises ValueError for ranks outside the job, a set that is
    already registered, or a set whose hosts run different numbers of its ranks."""
    group.engine()  # FastxferError before init() or in a forked child
    layout = group.layout()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps!r} is already registered")
    with process_sets.lock():
        if ps.mpi_comm is not None:
            ps.set_ranks(process_sets.comm_ranks(ps.mpi_comm))
        ranks = ps.ranks
        bad = [r for r in ranks if not 0 <= r < layout.size]
        if bad:
            raise ValueError(f"process set ranks {bad} are not ranks of this job (0..{layout.size - 1})")
        pid = process_sets.next_id()
        if ps.mpi_comm is None:
            _agree("add_process_set", [pid] + ranks, lambda w: f"id {w[0]}, ranks {w[1:]}")
            groups = [ranks]
        else:
            groups = _agree_on_partition(pid, ranks)
        # every check below reads only what every rank knows alike, so all ranks raise together
        dup = collectives.allgather(np.array([process_sets.find(ranks) is not None], np.int64),
                                    name="process_sets.add_process_set.registered")
        if dup.any():
            raise ValueError(f"a process set with ranks {ranks if dup[layout.rank] else 'like these'} is already "
                             "registered; Horovod allows one per list of ranks")
        spans = {}
        for g in groups:
            on_host: dict[int, list[int]] = {}
            for r in g:
                on_host.setdefault(layout.host_of_rank(r), []).append(r)
            if len({len(v) for v in on_host.values()}) > 1:
                raise ValueError(f"process set {g} has different numbers of ranks on its hosts "
                                 f"({', '.join(f'host {h}: {len(v)}' for h, v in sorted(on_host.items()))}); the "
                                 "hierarchical transport needs the same number on every host it spans")
            spans[tuple(g)] = on_host
        on_host = spans.get(tuple(ranks), {})
        sub = None
        if any(len(h) > 1 for h in spans.values()):  # every rank of the job takes part in the split
            from mpi4py import MPI

            mine = layout.rank in ranks and len(on_host) > 1
            sub = layout.mpi_comm.Split(color=ranks[0] if mine else MPI.UNDEFINED, key=layout.rank)
            if not mine:
                sub = None
        name = _create_segment(pid, ranks, on_host.get(layout.host_of_rank(layout.rank), []))
        engine = None
        if layout.rank in ranks:
            host = layout.host_of_rank(layout.rank)
            mine = on_host[host]
            inter = None
            if sub is not None:
                from fastxfer.comm.mpi import MPIInterHost

                inter = MPIInterHost(sub, mine.index(layout.rank), sorted(on_host).index(host))
            timeline = group.timeline_path(layout.rank)
            if timeline:
                root, ext = os.path.splitext(timeline)
                timeline = f"{root}.set{pid}{ext}"
            engine = group.make_engine(group.settings(), name, mine.index(layout.rank), len(mine), inter, timeline,
                                       layout.rank, mine, ranks, precreated=mine[0] == layout.rank)
        process_sets.record(ps, engine)
        return ps


def _create_segment(pid: int, ranks: list[int], mine: list[int]) -> str:
    """The set's shared-memory segment on this rank's host (``mine``: the set's ranks here, empty
    when this rank is not in the set). Collective on every rank of the job: the set's first rank on
    each host creates the segment under a fresh random name (128 bits, so no other local user can
    take the name first, as they could one derived from the job segment's visible name) and reserves
    its pages; then one allgather tells every rank the names, or a creator's failure (a full
    /dev/shm), which every rank then raises at once instead of waiting for a file that never comes.
    Returns the segment's path ("" when this rank is not in the set)."""
    status: tuple[str, str] | None = None
    made = ""
    if mine and mine[0] == group.rank():
        s = group.settings()
        path = f"{group.layout().segment}-s{pid}-{secrets.token_hex(16)}"
        try:
            _core.precreate_segment(path, len(mine), s["window"], s["oob"], group.MAX_RECORDS)
            made, status = path, ("ok", path)
        except (FastxferError, OSError, ValueError) as e:
            status = ("error", str(e))
    every = collectives.allgather_object(status, name="process_sets.add_process_set.segment")
    failed = [(r, st[1]) for r, st in enumerate(every) if st is not None and st[0] == "error"]
    if failed:
        if made:
            with contextlib.suppress(OSError):
                os.unlink(made)
        culprit, why = failed[0]
        me = group.rank()
        if me != culprit:
            group.engine().report(culprit, "failed", f"add_process_set({ranks}): {why}")
        raise FastxferError(f"add_process_set({ranks}): rank {culprit} could not create the set's shared memory"
                            f"{' (this rank)' if me == culprit else ''}, so no rank registered it: {why}")
    return every[mine[0]][1] if mine else ""


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set: collective on every rank of the job, like add_process_set. Its
    ranks stop its engine (collectively among themselves) and free its shared memory; later
    collectives on it raise ProcessSetRemovedError naming its id. Returns True; False when the set
    was never registered (on every rank alike). When its ranks stop it unevenly (a collective in
    flight on some of them) the set is removed all the same and every rank raises MismatchError
    naming what was left over (a request in flight fails too). ValueError for the global set and for a set that
    was removed already (ProcessSetRemovedError: every rank removed it, so every rank raises)."""
    group.engine()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set takes a ProcessSet, not {type(process_set).__name__}")
    if process_set.process_set_id == 0:
        raise ValueError("the global process set cannot be removed: it is every rank of the job (shutdown() ends it)")
    if process_set.process_set_id is None and process_set.removed_id is not None:
        raise ProcessSetRemovedError(f"process set {process_set.removed_id} (ranks {process_set.ranks}) was removed "
                                     "already: remove_process_set takes a set once")
    with process_sets.lock():
        known = process_sets.is_registered(process_set)
        pid = process_set.process_set_id if known else -1
        _agree("remove_process_set", [pid], lambda w: f"id {w[0]}" if w[0] >= 0 else "unregistered")
        if not known:
            return False
        try:
            process_sets.forget(process_set)  # gone from the registry even when its engine failed
            why = ""
        except FastxferError as e:  # e.g. a member had a collective on it in flight, the others not
            why = f"{type(e).__name__}: {e}"
        # every rank of the job learns how the set's ranks stopped it, so all return or all raise
        every = collectives.allgather_object(why, name="process_sets.remove_process_set.stopped")
        failed = [(r, w) for r, w in enumerate(every) if w]
        if failed:
            raise MismatchError(f"remove_process_set: process set {pid} (ranks {process_set.ranks}) is removed, but its "
                                f"ranks had not run the same collectives on it ({'; '.join(f'rank {r}: {w}' for r, w in failed)}); "
                                "wait for every collective on a set, on all of its ranks, before removing it")
        return True


def _register_at_init(sets: list) -> None:
    for ps in sets:
        add_process_set(ps)


group.after_init(_register_at_init)
