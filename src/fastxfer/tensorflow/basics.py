"""Horovod's rank, capability and timeline queries, answered truthfully for fastxfer's CPU build:

- ``size_op``, ``rank_op``, ``local_size_op``, ``local_rank_op``: int32 scalar tensors; inside a
  ``tf.function`` read when the graph runs, as Horovod's ops.
- ``cross_rank()`` / ``cross_size()``: this host's index / the number of hosts (the job's layout;
  0 / 1 on one host).
- ``is_homogeneous()``: True -- fastxfer refuses jobs whose hosts run different numbers of ranks.
- ``mpi_built()``: whether the MPI bridge between hosts can be used (mpi4py is installed).
- ``mpi_enabled()``: whether this process initialised MPI (a job started by mpirun, MPICH or
  horovodrun).
- ``mpi_threads_supported()``: as Horovod, ValueError unless MPI is enabled; then whether MPI runs
  with MPI_THREAD_MULTIPLE.
- ``gloo_built/enabled``, ``ddl_built``, ``ccl_built``, ``cuda_built``, ``rocm_built``,
  ``sycl_built``: False, fastxfer has none of these backends; ``nccl_built()``: 0 (Horovod returns
  the NCCL version, 0 without NCCL).
- ``start_timeline`` / ``stop_timeline``: the job's timeline at run time, one Chrome trace with a
  row per rank on a common clock (fastxfer.comm.timeline); every rank calls them.

Process sets (``ProcessSet``, ``global_process_set``, ``add_process_set``, ``remove_process_set``)
are fastxfer.comm.process_sets': each registered set runs its own engine among its ranks.
``size_op(process_set_id)`` is that set's size, ``process_set_included_op(process_set_id)`` 1 or 0.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import tensorflow as tf

import fastxfer as fx
from fastxfer.comm import group, process_sets, timeline
from fastxfer.comm.process_sets import ProcessSet, global_process_set
from fastxfer.comm.set_registration import add_process_set, remove_process_set

__all__ = ["ProcessSet", "add_process_set", "ccl_built", "cross_rank", "cross_size",
           "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "global_process_set", "is_homogeneous",
           "local_rank_op", "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
           "process_set_included_op", "rank_op", "remove_process_set", "rocm_built", "size_op", "start_timeline",
           "stop_timeline", "sycl_built"]


def _scalar_op(read, name):
    """An int32 scalar: eagerly the value now; traced, an op that reads it when the graph runs."""
    if tf.executing_eagerly():
        return tf.constant(read(), tf.int32, name=name)
    t = tf.numpy_function(lambda: np.int32(read()), [], tf.int32, stateful=True, name=name or "fastxfer_query")
    t.set_shape([])
    return t


def size_op(process_set_id=0, name=None):
    """The number of ranks (of process set ``process_set_id``), as an int32 scalar tensor."""
    ps = _by_id(process_set_id)
    return _scalar_op(fx.size if ps is global_process_set else ps.size, name)


def rank_op(name=None):
    """This process's rank, as an int32 scalar tensor."""
    return _scalar_op(fx.rank, name)


def local_size_op(name=None):
    """The number of ranks on this host, as an int32 scalar tensor."""
    return _scalar_op(fx.local_size, name)


def local_rank_op(name=None):
    """This process's rank on its host, as an int32 scalar tensor."""
    return _scalar_op(fx.local_rank, name)


def process_set_included_op(process_set_id=0, name=None):
    """1 when this rank belongs to process set ``process_set_id``, else 0 (int32 scalar tensor)."""
    ps = _by_id(process_set_id)
    return _scalar_op(lambda: int(ps is global_process_set or ps.included()), name)


def cross_size() -> int:
    """The number of hosts in the job."""
    return group.layout().hosts


def cross_rank() -> int:
    """This host's index among the job's hosts (0 on one host): the rank among the processes that
    have this process's local rank, one per host, as Horovod's cross communicator."""
    lay = group.layout()
    if lay.hosts == 1 or lay.inter_host is None:
        return 0
    return int(lay.inter_host.cross.Get_rank())


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks. Always True in fastxfer: a job whose
    hosts run different numbers is refused at init()."""
    group.layout()  # raises before init(), as the other queries
    return True


def mpi_built() -> bool:
    """Whether fastxfer can use MPI between hosts: its MPI bridge runs on mpi4py (the 'mpi' extra)."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """Whether MPI is in use in this process (the job was started by mpirun, MPICH or horovodrun,
    and fastxfer met the other ranks through MPI)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return bool(mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized())


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE (so other MPI libraries such as mpi4py may be used
    next to fastxfer). As Horovod: ValueError when MPI is not enabled in this job."""
    if not fx.is_initialized():
        raise ValueError("fastxfer has not been initialized; use hvd.init().")
    if not mpi_enabled():
        raise ValueError("MPI is not enabled in this job (it was not started by mpirun/MPICH/horovodrun); "
                         "mpi_threads_supported() has no answer")
    mpi = sys.modules["mpi4py.MPI"]
    return mpi.Query_thread() == mpi.THREAD_MULTIPLE


def gloo_built() -> bool:
    """False: fastxfer has no Gloo backend (shared memory on a host, MPI between hosts)."""
    return False


def gloo_enabled() -> bool:
    """False: fastxfer has no Gloo backend."""
    return False


def nccl_built() -> int:
    """0: no NCCL (Horovod returns the NCCL version code, 0 without NCCL)."""
    return 0


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL (fastxfer's CPU collectives are its own)."""
    return False


def cuda_built() -> bool:
    """False: fastxfer is a CPU library."""
    return False


def rocm_built() -> bool:
    """False: fastxfer is a CPU library."""
    return False


def sycl_built() -> bool:
    """False: fastxfer is a CPU library."""
    return False


def start_timeline(file_path, mark_cycles=False):
    """Starts recording the job's timeline into ``file_path``: one Chrome-trace file (Perfetto,
    chrome://tracing) with a row per rank on a common clock, written by rank 0 at stop_timeline() or
    shutdown. ``mark_cycles``: an event at every negotiation round. Every rank calls it (as every
    rank runs the script); ValueError while one is already recording."""
    timeline.start(file_path, mark_cycles)


def stop_timeline():
    """Stops the timeline; rank 0 writes the file. Every rank calls it (a collective)."""
    timeline.stop()


def _by_id(process_set_id):
    if isinstance(process_set_id, bool) or not isinstance(process_set_id, (int, np.integer)):
        raise TypeError(f"process_set_id must be an int, not {process_set_id!r}")
    return process_sets.by_id(int(process_set_id))
