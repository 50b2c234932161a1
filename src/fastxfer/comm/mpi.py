"""The link between hosts, on mpi4py: used by the hierarchical transport (shared memory inside
each host, MPI between hosts). The engine thread calls these methods; mpi4py releases the GIL
while MPI works.

Communicators (all split or duplicated from COMM_WORLD, so fastxfer never disturbs the user's):
``cross``: the ranks with this rank's local rank, one per host (each carries its shard of every
chunk); ``world``: agreement rounds, broadcast, allgather; ``oob``: oob_allreduce, which runs on
the caller's thread concurrently with the engine (MPI_THREAD_MULTIPLE is required).
"""

from __future__ import annotations

import numpy as np

from fastxfer import _core
from fastxfer import _validate as check
from fastxfer.errors import FastxferError, MismatchError


class MPIInterHost:
    """The InterHost the native hierarchical transport calls (csrc/transport/inter_host.h): dtype
    and op arrive by name, buffers as uint8 views of the engine's memory."""

    def __init__(self, comm, local_rank: int, host_index: int):
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise FastxferError("fastxfer's MPI transport needs MPI_THREAD_MULTIPLE (mpi4py's default); this MPI "
                                f"was initialised with thread level {MPI.Query_thread()}")
        self._MPI = MPI
        self.world = comm.Dup()
        self.oob = comm.Dup()
        self.cross = comm.Split(color=local_rank, key=host_index)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.native = self._native_config(MPI)
        self._builtin = {"sum": MPI.SUM, "average": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}
        # bool (one byte, 0 or 1): sum and max are a logical or, min and product a logical and
        self._bool_ops = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "product": MPI.LAND}
        self._mpi_types = {"float32": MPI.FLOAT, "float64": MPI.DOUBLE, "int32": MPI.INT32_T, "int64": MPI.INT64_T,
                           "uint8": MPI.UINT8_T, "int8": MPI.INT8_T, "uint16": MPI.UINT16_T, "int16": MPI.INT16_T}
        self._ops: dict[tuple[str, str], object] = {}

    # The MPI families whose ABI csrc/transport/mpi_native.cc knows, by mpi4py's vendor name.
    FAMILIES = {"Open MPI": "openmpi", "MPICH": "mpich", "Intel MPI": "mpich", "MVAPICH": "mpich",
                "MVAPICH2": "mpich"}

    def _native_config(self, MPI) -> dict | None:
        """What the engine needs to call MPI's C API itself (csrc/transport/mpi_native.h): the
        loaded library, its ABI family and the communicators' handles. None (the mpi4py path)
        with FASTXFER_NATIVE_MPI=0 or an MPI whose ABI it does not know."""
        from fastxfer import settings

        family = self.FAMILIES.get(MPI.get_vendor()[0])
        if not settings.get("FASTXFER_NATIVE_MPI") or family is None:
            return None
        return {"library": MPI.__file__, "family": family, "world": MPI._handleof(self.world),
                "cross": MPI._handleof(self.cross), "oob": MPI._handleof(self.oob), "rank": self.rank,
                "size": self.size, "cross_rank": self.cross.Get_rank(), "cross_size": self.cross.Get_size(),
                "spin_us": settings.get("FASTXFER_SPIN_US"), "small_bytes": int(settings.get("FASTXFER_NET_SMALL_KB") * 1024)}

    @property
    def transport(self) -> str:
        """How the engine reaches the other hosts: "native MPI (<family>)" or "mpi4py"."""
        return f"native MPI ({self.native['family']})" if self.native else "mpi4py"

    # -- 16-bit floats: MPI has no bf16/fp16 sum; reduce with fastxfer's kernels ------------------
    def _op16(self, dtype: str, op: str):
        key = (dtype, op)
        if key not in self._ops:
            wire = check.DTYPES[dtype]
            kind = check.wire_kind(dtype)

            def combine(inbuf, inoutbuf, datatype, wire=wire, kind=kind, op=op):
                a = np.frombuffer(inbuf, wire)
                b = np.frombuffer(inoutbuf, wire)
                if op in ("sum", "average"):
                    _core.sum_compress(a, b, b, kind, 1)  # b = round(a + b), in float32
                elif op == "product":
                    np.copyto(b, (a.astype(np.float32) * b.astype(np.float32)).astype(wire))
                else:
                    f = np.minimum if op == "min" else np.maximum
                    np.copyto(b, f(a.astype(np.float32), b.astype(np.float32)).astype(wire))

            self._ops[key] = self._MPI.Op.Create(combine, commute=True)
        return self._ops[key]

    # -- 8/16-bit integer sums and products: numpy's, which wrap --------------------------------------
    # Open MPI 5's vectorised MPI_SUM on UINT8_T saturates (200 + 100 gave 255 here), while fastxfer
    # wraps modulo 2^bits everywhere (docs/algorithms.md); so these never use MPI's built-in op.
    def _op_small(self, dtype: str, op: str):
        key = (dtype, op)
        if key not in self._ops:
            dt = check.DTYPES[dtype]
            f = np.multiply if op == "product" else np.add

            def combine(inbuf, inoutbuf, datatype, dt=dt, f=f):
                b = np.frombuffer(inoutbuf, dt)
                f(np.frombuffer(inbuf, dt), b, out=b)

            self._ops[key] = self._MPI.Op.Create(combine, commute=True)
        return self._ops[key]

    def _reduce(self, comm, buf: np.ndarray, dtype: str, op: str) -> None:
        MPI = self._MPI
        if dtype in ("uint8", "int8", "uint16", "int16") and op in ("sum", "average", "product"):
            comm.Allreduce(MPI.IN_PLACE, [buf.view(check.DTYPES[dtype]), self._mpi_types[dtype]],
                           op=self._op_small(dtype, op))
        elif dtype == "bool":
            # MPI's logical ops on one-byte values (MPI.C_BOOL); any non-zero byte is true
            comm.Allreduce(MPI.IN_PLACE, [buf.view(np.uint8), MPI.C_BOOL], op=self._bool_ops[op])
        elif dtype in self._mpi_types:
            comm.Allreduce(MPI.IN_PLACE, [buf.view(check.DTYPES[dtype]), self._mpi_types[dtype]],
                           op=self._builtin[op])
        else:
            comm.Allreduce(MPI.IN_PLACE, [buf.view(np.uint16), MPI.UINT16_T], op=self._op16(dtype, op))

    # -- InterHost ----------------------------------------------------------------------------------
    # Across 3 or more hosts, sums of shards this large go through _sum_scattered: Open MPI's own
    # allreduce picks algorithms that move more (1.9x the bandwidth optimum measured on 3 hosts for
    # float32); smaller ones keep MPI's latency-bound algorithms.
    SCATTER_MIN_BYTES = 64 << 10

    def allreduce_shard(self, buf: np.ndarray, dtype: str, op: str) -> None:
        hosts = self.cross.Get_size()
        sixteen = dtype in ("bfloat16", "float16")
        big = sixteen or buf.nbytes >= self.SCATTER_MIN_BYTES
        if hosts > 2 and op in ("sum", "average") and dtype != "bool" and big:
            self._sum_scattered(buf, dtype)
        else:
            self._reduce(self.cross, buf, dtype, op)

    def _sum_scattered(self, buf: np.ndarray, dtype: str) -> None:
        """A sum across 3 or more hosts as a reduce-scatter and an allgather: each host sends the
        j-th piece of its shard to host j (``Alltoallv``), host j adds the pieces in host order and
        an ``Allgatherv`` returns every piece to every host. Each host sends ``2(h-1)/h`` of the
        shard, the ring's optimum, and every host gets the same bits. 16-bit floats travel as they
        are and are added in float32 and rounded once, so the error does not grow with the number
        of hosts (MPI's reduction tree would round every partial sum); integers wrap, as fastxfer's
        sums do everywhere (docs/algorithms.md, "Across hosts")."""
        MPI = self._MPI
        comm = self.cross
        hosts, me = comm.Get_size(), comm.Get_rank()
        wire = check.DTYPES[dtype]
        es = np.dtype(wire).itemsize
        n = buf.nbytes // es
        counts = [n // hosts + (1 if j < n % hosts else 0) for j in range(hosts)]
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        k = counts[me]
        b = [c * es for c in counts]
        d = [s * es for s in starts]
        recv = np.empty(hosts * k * es, np.uint8)
        x = buf.view(np.uint8)
        comm.Alltoallv([x, (b, d), MPI.BYTE], [recv, ([k * es] * hosts, [k * es * j for j in range(hosts)]), MPI.BYTE])
        pieces = recv.view(wire).reshape(hosts, k)
        if dtype in ("bfloat16", "float16"):
            acc = pieces[0].astype(np.float32)
            for j in range(1, hosts):
                acc += pieces[j].astype(np.float32)
            mine = acc.astype(wire)
        else:
            mine = pieces[0].copy()
            for j in range(1, hosts):
                np.add(mine, pieces[j], out=mine)  # integers wrap modulo 2^bits
        comm.Allgatherv([np.ascontiguousarray(mine).view(np.uint8), MPI.BYTE], [x, (b, d), MPI.BYTE])

    def allgather_bytes_across(self, b: bytes) -> list[bytes]:
        return self.cross.allgather(bytes(b))

    def allgather_bytes(self, b: bytes) -> list[bytes]:
        return self.world.allgather(bytes(b))

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self.world.Bcast([buf, self._MPI.BYTE], root=root)

    def allgatherv(self, mine: np.ndarray, out: np.ndarray, sizes: list[int]) -> None:
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        self.world.Allgatherv([mine, self._MPI.BYTE], [out, (list(map(int, sizes)), displs), self._MPI.BYTE])

    def alltoallv(self, mine: np.ndarray, out: np.ndarray, send: list[int], recv: list[int]) -> None:
        sd = np.concatenate([[0], np.cumsum(send)[:-1]]).astype(int).tolist()
        rd = np.concatenate([[0], np.cumsum(recv)[:-1]]).astype(int).tolist()
        self.world.Alltoallv([mine, (list(map(int, send)), sd), self._MPI.BYTE],
                             [out, (list(map(int, recv)), rd), self._MPI.BYTE])

    def oob_allreduce(self, src: np.ndarray, out: np.ndarray, dtype: str, op: str, what: str) -> None:
        # `what` names the request (name, dtype, shape, op): every rank must send the same
        whats = self.oob.allgather(what)
        if any(w != whats[0] for w in whats):
            first = next(r for r, w in enumerate(whats) if w != whats[0])
            raise MismatchError(f"oob_allreduce: rank 0 submitted {whats[0]} but rank {first} submitted {whats[first]}")
        np.copyto(out, src)
        self._reduce(self.oob, out, dtype, op)
