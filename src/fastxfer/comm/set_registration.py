"""Registering and removing process sets: ``add_process_set``, ``remove_process_set`` and
``init(process_sets=...)``. Both calls are collective on every rank of the job; the ranks first
agree, over the job's engine, that they were given the same set (comm/process_sets.py has the
model; docs/architecture.md, "Process sets", the design)."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from fastxfer.comm import collectives, group, process_sets
from fastxfer.comm.process_sets import ProcessSet
from fastxfer.errors import MismatchError


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
        _agree("add_process_set", [pid] + ranks, lambda w: f"id {w[0]}, ranks {w[1:]}")
        other = process_sets.find(ranks)
        if other is not None:
            raise ValueError(f"a process set with ranks {ranks} is already registered ({other!r}); Horovod "
                             "allows one per list of ranks")
        on_host: dict[int, list[int]] = {}
        for r in ranks:
            on_host.setdefault(layout.host_of_rank(r), []).append(r)
        if len({len(v) for v in on_host.values()}) > 1:
            raise ValueError(f"process set {ranks} has different numbers of ranks on its hosts "
                             f"({', '.join(f'host {h}: {len(v)}' for h, v in sorted(on_host.items()))}); the "
                             "hierarchical transport needs the same number on every host it spans")
        sub = None
        if len(on_host) > 1:  # every rank of the job takes part in the split, members or not
            from mpi4py import MPI

            sub = layout.mpi_comm.Split(color=0 if layout.rank in ranks else MPI.UNDEFINED, key=layout.rank)
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
            engine = group.make_engine(group.settings(), f"{layout.segment}-s{pid}", mine.index(layout.rank),
                                       len(mine), inter, timeline, layout.rank, mine, ranks)
        process_sets.record(ps, engine)
        return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set: collective on every rank of the job, like add_process_set. Its
    ranks stop its engine (collectively among themselves) and free its shared memory. Returns
    True; False when the set was not registered (on every rank alike)."""
    group.engine()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set takes a ProcessSet, not {type(process_set).__name__}")
    if process_set.process_set_id == 0:
        raise ValueError("the global process set cannot be removed")
    with process_sets.lock():
        known = process_sets.is_registered(process_set)
        pid = process_set.process_set_id if known else -1
        _agree("remove_process_set", [pid], lambda w: f"id {w[0]}" if w[0] >= 0 else "unregistered")
        if not known:
            return False
        process_sets.forget(process_set)
        return True


def _register_at_init(sets: list) -> None:
    for ps in sets:
        add_process_set(ps)


group.after_init(_register_at_init)
