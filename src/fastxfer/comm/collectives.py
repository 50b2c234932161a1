"""Collectives on numpy arrays: allreduce (sync and async), oob_allreduce, broadcast, allgather,
alltoall, reducescatter (and grouped), barrier, broadcast_object, allgather_object. Every rank must
issue the same collectives in the same order; names (automatic if not given) and shapes are
checked, and a disagreement raises MismatchError on every rank.

Every collective takes ``process_set=``: None (every rank) or a registered ProcessSet
(comm/process_sets.py), whose ranks alone then take part, on that set's own engine."""

from __future__ import annotations

import itertools
import os
import pickle
import threading
from dataclasses import replace

import numpy as np

from fastxfer import _core
from fastxfer import _validate as check
from fastxfer.comm import group, options, process_sets

_lock = threading.Lock()
_counters: dict[str, itertools.count] = {}
_keepalive: dict[int, tuple] = {}  # buffers the engine may still read or write, by request id


@group.on_shutdown
def _forget() -> None:
    # per-job state: the next init() numbers automatic names from 0 again, as every rank does
    with _lock:
        _counters.clear()
        _keepalive.clear()


# Results from this size up come from the output pool (csrc/common/output_pool.h): a buffer freed with
# an earlier result is reused instead of fresh memory, which would be faulted in and zeroed by the
# kernel on every call (docs/architecture.md, "Fresh outputs"). Below it np.empty_like is as fast.
_POOL_MIN_BYTES = 64 << 10


def _fresh_like(a: np.ndarray) -> np.ndarray:
    """A new, uninitialised, C-contiguous array of a's shape and dtype, owned by the caller."""
    if a.nbytes >= _POOL_MIN_BYTES:
        return _core.pool_empty(a.shape, a.dtype)
    return np.empty_like(a)


def _counter(key: str) -> itertools.count:
    c = _counters.get(key)
    if c is None:
        with _lock:
            c = _counters.setdefault(key, itertools.count())
    return c


def _auto_name(kind: str, ps=None) -> str:
    # numbered per process set: only a set's ranks call its collectives
    key = kind if ps is None else f"{kind}.set{ps.process_set_id}"
    return f"{key}.{next(_counter(key))}"  # next() on a count is one step under the GIL: no lock needed


def _sweep(eng) -> None:
    for i in eng.take_finished():
        _keepalive.pop(i, None)


class Handle:
    """A collective in flight. ``wait()`` blocks (without the GIL) and returns the result."""

    __slots__ = ("_id", "_out", "_kind", "_shape", "_dtype", "_result", "_eng")

    def __init__(self, eng, rid: int, out, kind: str, shape=None, dtype=None):
        self._eng, self._id, self._out, self._kind, self._shape, self._dtype = eng, rid, out, kind, shape, dtype
        self._result = None

    def done(self) -> bool:
        """Whether the collective has finished (wait() would not block)."""
        return self._result is not None or self._eng.done(self._id)

    def wait(self) -> np.ndarray | None:
        """Block until done and return the result array; raises the collective's error."""
        if self._result is not None:
            return self._result
        try:
            self._eng.wait(self._id)
            if self._kind in ("allgather", "alltoall", "reducescatter"):
                raw, rows, splits = self._eng.take_gathered(self._id)
                self._out = raw.view(self._dtype).reshape((rows,) + tuple(self._shape[1:]))
                if self._kind == "alltoall":
                    self._out = (self._out, np.asarray(splits, np.int64))
            elif self._kind == "join":
                self._out = self._eng.joined_last(self._id)
        finally:
            self._eng.release(self._id)
            with _lock:
                _keepalive.pop(self._id, None)
        self._result = self._out if self._out is not None else ()
        return self._out

    def __del__(self):
        # Dropped without wait(): the engine forgets the request when it finishes (an allgather's
        # result is freed with it); the inputs stay alive in _keepalive until then.
        if self._result is None:
            try:
                self._eng.detach(self._id)
            except Exception:  # interpreter shutdown, or an engine that is gone
                pass


def submit(opts: options.CollectiveOptions, arr, out=None, sync: bool = False, splits=()) -> Handle:
    """Hand one collective to the engine of ``opts``' process set: ``arr`` (None for barrier and
    join) already checked against ``opts``, ``out`` the result buffer (None: the engine allocates
    it, for the gathering kinds). ``opts.name`` None: numbered automatically. ``sync``: the caller
    waits at once, and its wait() runs the round on this thread (engine.h). The one way every
    collective on arrays -- numpy's, and the TensorFlow bridge's -- reaches the engine."""
    eng = process_sets.engine_of(opts.process_set)
    name = opts.name if opts.name is not None else _auto_name(opts.kind, opts.process_set)
    with _lock:
        _sweep(eng)
        rid = eng.submit(opts.kind, name, arr, out, opts.op, opts.wire_for(arr.dtype) if arr is not None else "none",
                         opts.root, opts.prescale, opts.postscale, opts.bucket_cap, sync, list(splits))
        _keepalive[rid] = (arr, out)
    return Handle(eng, rid, out, opts.kind, None if arr is None else arr.shape, None if arr is None else arr.dtype)


def allreduce_async(array, op: str = "average", compression: str = "none", name: str | None = None,
                    prescale: float = 1.0, postscale: float = 1.0, out: np.ndarray | None = None,
                    bucket_cap_mb: float | None = None, process_set=None) -> Handle:
    """Start reducing ``array`` across all ranks; returns a Handle whose ``wait()`` gives a new array.

    ``op``: sum, average, min or max. ``compression``: none, bf16 or fp16 — float32 only: the data
    travels rounded to 16 bits and is reduced in float32 (results carry the 16-bit rounding error,
    see docs/algorithms.md). ``prescale``/``postscale`` multiply before / after the reduction.
    ``out``: write the result there instead of a new array (``out=array`` reduces in place). A new
    array's memory comes from the output pool (FASTXFER_OUTPUT_POOL_MB): drop results you no
    longer need and the next call of the same size reuses their memory.
    The input must stay unchanged until ``wait()`` returns. ``bucket_cap_mb``: the fusion bucket
    cap for this request (consecutive requests fuse only when their caps agree; every rank must
    pass the same value); None uses ``init``'s. ``process_set``: reduce among that set's ranks
    only (an average divides by its size).
    """
    return _allreduce(array, options.allreduce(op, compression, prescale, postscale, bucket_cap_mb, process_set, name),
                      out, False)


def _allreduce(array, opts: options.CollectiveOptions, out, sync) -> Handle:
    a = check.array(array)
    opts.check_dtype(a.dtype)
    out = _fresh_like(a) if out is None else check.out_like(out, a)
    return submit(opts, a, out, sync)


# The checked plan of the common call (every rank, automatic name), by its arguments and the
# array's dtype: building and checking the options cost more than a small allreduce itself
# (docs/architecture.md, "Small allreduces"). Nothing in it depends on the job, so it outlives init().
_allreduce_plans: dict = {}
_PLANS_MAX = 256


def _allreduce_plan(op, compression, prescale, postscale, bucket_cap_mb, process_set, name, dtype):
    """``(options, wire)`` of an allreduce of ``dtype`` data: options.allreduce(...) checked against
    the dtype (opts.check_dtype) and its wire format, remembered for calls without a name or a
    process set."""
    if process_set is not None or name is not None:
        opts = options.allreduce(op, compression, prescale, postscale, bucket_cap_mb, process_set, name)
        opts.check_dtype(dtype)
        return opts, opts.wire_for(dtype)
    # the types too: 1 == 1.0 == True as keys, but only some of them are valid arguments
    key = (op, compression, type(prescale), prescale, type(postscale), postscale, type(bucket_cap_mb), bucket_cap_mb,
           dtype)
    try:
        plan = _allreduce_plans.get(key)
    except TypeError:  # an unhashable argument: checked (and refused) the long way
        plan = None
        key = None
    if plan is None:
        opts = options.allreduce(op, compression, prescale, postscale, bucket_cap_mb, process_set, name)
        opts.check_dtype(dtype)
        plan = (opts, opts.wire_for(dtype))
        if key is not None and len(_allreduce_plans) < _PLANS_MAX:
            _allreduce_plans[key] = plan
    return plan


def run(opts: options.CollectiveOptions, wire: str, arr: np.ndarray, out: np.ndarray) -> np.ndarray:
    """A synchronous collective of ``opts`` from ``arr`` (checked; ``wire`` its wire format) into
    ``out``: one native call that submits, runs the round on this thread and waits without the GIL.
    No handle and nothing kept alive: the caller holds both arrays until it returns, and the engine
    does not report the request to take_finished(). Returns ``out``."""
    eng = group.engine() if opts.process_set is None else process_sets.engine_of(opts.process_set)
    name = opts.name if opts.name is not None else _auto_name(opts.kind, opts.process_set)
    eng.run(opts.kind, name, arr, out, opts.op, wire, opts.root, opts.prescale, opts.postscale, opts.bucket_cap)
    return out


# allreduce's scale defaults, as objects: a call that leaves them alone passes these very objects,
# which the shortcut below recognises by identity (a caller's own 1.0 takes the long way).
_ONE = 1.0
# The shortcut's state for the running engine: (engine, name counter, {(op, compression, dtype):
# _core.PlainAllreduce, the engine call with the checked plan bound}), for calls that give at most
# `op` and `compression` (as strings) besides `array` and `out` (docs/architecture.md, "Small
# allreduces"). Made by the first such call of each kind; dropped whenever the group drops its
# engine (shutdown, a leave) and in a forked child, which takes the long way to its error.
_plain_calls: tuple | None = None


@group.on_shutdown
def _forget_plain_calls() -> None:
    global _plain_calls
    _plain_calls = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_plain_calls)


def allreduce(array, op: str = "average", compression: str = "none", name: str | None = None,
              prescale: float = _ONE, postscale: float = _ONE, out: np.ndarray | None = None,
              bucket_cap_mb: float | None = None, process_set=None) -> np.ndarray:
    """Reduce ``array`` across all ranks and return the result (see allreduce_async)."""
    plain = (name is None and prescale is _ONE and postscale is _ONE and bucket_cap_mb is None and process_set is None
             and type(op) is str and type(compression) is str)
    known = _plain_calls
    if plain and known is not None and type(array) is np.ndarray:
        # The shortcut: a call this engine has checked before, in one native call that refuses
        # (False, nothing run, no name taken) anything but a C-contiguous input and a fitting `out`.
        call = known[2].get((op, compression, array.dtype))
        if call is not None:
            result = _fresh_like(array) if out is None else out
            if call(array, result):
                return result
    a = check.array(array)
    opts, wire = _allreduce_plan(op, compression, prescale, postscale, bucket_cap_mb, process_set, name, a.dtype)
    if opts.process_set is not None or opts.name is not None:
        return run(opts, wire, a, _fresh_like(a) if out is None else check.out_like(out, a))
    # The common call in one native step (the Python around it is as long as the collective at a
    # few KiB): the engine checks `out` as check.out_like would and takes the automatic name.
    if out is None:
        out = _fresh_like(a)
    eng, counter = group.engine(), _counter("allreduce")
    args = (opts.op, wire, opts.prescale, opts.postscale, opts.bucket_cap)
    if not eng.allreduce_into(counter, "allreduce.", a, out, *args):
        check.out_like(out, a)  # raises, naming what is wrong with it
        raise AssertionError(f"the engine refused out={out!r} that check.out_like accepts")
    if plain:
        _remember_plain_call(eng, counter, (op, compression, a.dtype), args)
    return out


def _remember_plain_call(eng, counter, key, args) -> None:
    global _plain_calls
    known = _plain_calls
    if known is None or known[0] is not eng or known[1] is not counter:
        known = _plain_calls = (eng, counter, {})
    if len(known[2]) < _PLANS_MAX:
        known[2][key] = _core.PlainAllreduce(eng, counter, "allreduce.", *args)


def oob_allreduce(array, op: str = "average", name: str | None = None, process_set=None) -> np.ndarray:
    """Reduce a small array (metrics, flags) on a lane of its own: it never waits behind gradient
    buckets. Runs on the calling thread; the GIL is released while waiting."""
    opts = options.allreduce(op, process_set=process_set, name=name)
    if opts.op == "adasum":
        raise ValueError("oob_allreduce does not take op='adasum' (it is for metrics and flags): use allreduce")
    eng = process_sets.engine_of(opts.process_set)
    a = check.array(array)
    opts.check_dtype(a.dtype)
    if a.nbytes > eng.oob_capacity:
        raise ValueError(f"oob_allreduce is for small arrays (at most {eng.oob_capacity} bytes); this one has "
                         f"{a.nbytes}: use allreduce")
    out = np.empty_like(a)
    post = 1.0 / opts.size if opts.op == "average" else 1.0
    eng.oob_allreduce(a, out, name if name is not None else _auto_name("oob_allreduce", opts.process_set), opts.op,
                      post)
    return out


def broadcast(array, root: int = 0, name: str | None = None, process_set=None) -> np.ndarray:
    """Every rank gets a copy of ``root``'s array (shapes and dtypes must match on all ranks).
    In a process set, ``root`` is a rank of the job that belongs to the set."""
    opts = options.broadcast(root, process_set, name)
    a = check.array(array)
    return run(opts, "none", a, _fresh_like(a))


def allgather(array, name: str | None = None, process_set=None) -> np.ndarray:
    """Concatenate every rank's array along axis 0, in rank order. First dimensions may differ;
    the other dimensions and the dtype must match."""
    opts = options.gather("allgather", process_set, name)
    a = check.array(array)
    check_first_dim(a.ndim, "allgather")
    return submit(opts, a, sync=True).wait()


def check_first_dim(ndim, what: str) -> None:
    """allgather, alltoall and reducescatter work along the first dimension, of at most 8
    (``ndim`` None: not known yet, a traced tensor)."""
    if ndim == 0:
        how = "concatenates along" if what == "allgather" else "splits"
        raise ValueError(f"{what} needs at least one dimension (it {how} the first one); use a[None]")
    if ndim is not None and ndim > 8:
        raise ValueError(f"{what} supports at most 8 dimensions, not {ndim}; reshape first")


def split_counts(splits) -> list[int]:
    """``splits`` as a list of ints (None: [] = an equal split). The engine checks the values:
    one per rank, each >= 0, adding up to the first dimension."""
    if splits is None:
        return []
    s = np.asarray(splits)
    if s.ndim != 1 or (s.size and s.dtype.kind not in "iu"):
        raise TypeError(f"splits must be a 1-D sequence of ints (rows sent to each rank), not {splits!r}")
    return [int(v) for v in s]


def alltoall_async(array, splits=None, name: str | None = None, process_set=None) -> Handle:
    """Start an alltoall (see alltoall); ``wait()`` returns (received, received_splits)."""
    opts = options.gather("alltoall", process_set, name)
    a = check.array(array)
    check_first_dim(a.ndim, "alltoall")
    return submit(opts, a, splits=split_counts(splits))


def alltoall(array, splits=None, name: str | None = None, process_set=None) -> tuple[np.ndarray, np.ndarray]:
    """Horovod's alltoall: rank r sends rows [s_0 + ... + s_{j-1}, ... + s_j) of ``array`` (axis 0)
    to rank j, where ``splits`` = [s_0, ..., s_{size-1}] (default: an equal split, the first
    dimension divisible by size). Returns (received, received_splits): the rows every rank sent
    here, concatenated in rank order, and how many came from each rank (int64). Ranks' splits
    and first dimensions may differ; the other dimensions and the dtype must match. In a process
    set, ``splits`` has one entry per rank of the set, in the set's order."""
    opts = options.gather("alltoall", process_set, name)
    a = check.array(array)
    check_first_dim(a.ndim, "alltoall")
    return submit(opts, a, sync=True, splits=split_counts(splits)).wait()


def _reducescatter(array, opts: options.CollectiveOptions, sync) -> Handle:
    a = check.array(array)
    check_first_dim(a.ndim, "reducescatter")
    opts.check_dtype(a.dtype)
    return submit(opts, a, sync=sync)


def reducescatter(array, op: str = "average", name: str | None = None, prescale: float = 1.0,
                  postscale: float = 1.0, process_set=None) -> np.ndarray:
    """Horovod's reducescatter: reduce ``array`` (same shape on every rank) across ranks and return
    this rank's rows of the result. The first dimension is split as evenly as possible, the first
    (rows mod size) ranks getting one row more. ``op``: average or sum. Pre- and post-scale
    multiply the reduced values once (their product), after the sum."""
    return _reducescatter(array, options.reducescatter(op, "none", prescale, postscale, process_set, name), True).wait()


def grouped_reducescatter(arrays, op: str = "average", name: str | None = None, prescale: float = 1.0,
                          postscale: float = 1.0, process_set=None) -> list[np.ndarray]:
    """reducescatter of every array in the list, all submitted before any is waited for."""
    opts = options.reducescatter(op, "none", prescale, postscale, process_set)
    hs = [_reducescatter(a, opts if name is None else replace(opts, name=f"{name}.{i}"), False)
          for i, a in enumerate(arrays)]
    return [h.wait() for h in hs]


def barrier(process_set=None) -> None:
    """Returns once every rank (of the process set) has called barrier()."""
    submit(options.gather("barrier", process_set, "barrier"), None, sync=True).wait()


def join() -> int:
    """This rank has no more data (Horovod's ``join``): until every rank has joined, it takes part
    in the allreduces the others still run, contributing the op's neutral element (0 for sum and
    average -- an average still divides by size() --, 1 for product, +inf/-inf or the integer
    limits for min/max; bool: false for sum/max, true for min/product)
    and discarding the results. Other collectives while some ranks have joined are a
    MismatchError. Returns the rank that joined last, on every rank. Runs on the global set."""
    group.engine()  # FastxferError before init() (or in a forked child)
    return int(submit(options.gather("join", None, "join"), None, sync=True).wait())


def broadcast_object(obj, root: int = 0, name: str | None = None, process_set=None):
    """Broadcast a picklable Python object from ``root`` (small objects: options, epoch numbers)."""
    me = group.rank()
    if me == root:
        data = pickle.dumps(obj)
        words = np.frombuffer(data + b"\0" * (-len(data) % 8), np.int64)
    n = int(broadcast(np.array([len(data) if me == root else 0], np.int64), root=root,
                      name=None if name is None else f"{name}.size", process_set=process_set)[0])
    got = broadcast(words if me == root else np.zeros((n + 7) // 8, np.int64), root=root,
                    name=None if name is None else f"{name}.data", process_set=process_set)
    return obj if me == root else pickle.loads(got.tobytes()[:n])


def allgather_object(obj, name: str | None = None, process_set=None) -> list:
    """Every rank's picklable object, in rank order (of the process set)."""
    data = pickle.dumps(obj)
    sizes = allgather(np.array([len(data)], np.int64), name=None if name is None else f"{name}.sizes",
                      process_set=process_set)
    words = np.frombuffer(data + b"\0" * (-len(data) % 8), np.int64)
    got = allgather(words, name=None if name is None else f"{name}.data", process_set=process_set).tobytes()
    out, off = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(got[off:off + n]))
        off += n + (-n % 8)
    return out


__all__ = ["Handle", "allgather", "allgather_object", "allreduce", "allreduce_async", "alltoall", "alltoall_async",
           "barrier", "broadcast", "broadcast_object", "check_first_dim", "grouped_reducescatter", "join",
           "oob_allreduce", "reducescatter", "split_counts", "submit"]
