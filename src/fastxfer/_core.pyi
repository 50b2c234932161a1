"""Type stubs for ``fastxfer._core``, the native module (csrc/bindings): SIMD kernels, fused
buckets, the collective engine, topology and placement, and the JPEG input pipeline.

Private: call it through the package. Argument validation lives in ``fastxfer._validate``; the
native side only makes sure every buffer it is handed fits (dtype, layout, size: TypeError /
ValueError naming the argument). Engine and topology failures come back as ``fastxfer.errors``
types (PeerFailureError, MismatchError, FastxferError, TopologyError)."""

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__version__: str

# ---- process-wide settings (fastxfer/__init__.py applies fastxfer.settings' values at import) ----

def set_log_level(level: int) -> None:
    """The level (Python's numbers) below which the native core's own messages are dropped: the `fastxfer`
    logger's (fastxfer/log.py)."""
def log_level() -> int:
    """The native core's message level (set_log_level)."""
def configure(simd_level: str, threads: int, output_pool_cap_bytes: int) -> None:
    """The process-wide settings: the kernel path ("": the best this CPU supports; ValueError for one it
    cannot run), the kernels' default thread count (0: the CPUs of the affinity mask) and the output pool's
    cap in bytes. The core reads no environment variable: these come from FASTXFER_SIMD, FASTXFER_THREADS
    and FASTXFER_OUTPUT_POOL_MB through fastxfer.settings."""

# ---- CPU features and kernel dispatch ----------------------------------------------------------

def simd_level() -> str:
    """The active kernel path: 'scalar', 'avx2', 'avx512' or 'avx512bf16' (or the aarch64 names)."""

def supported_simd_levels() -> list[str]:
    """Every kernel path this CPU can run, slowest first."""

def _set_simd_level(level: str) -> None:
    """Testing hook: switch the kernel path (ValueError for an unknown or unsupported level)."""

class CpuFeatures:
    """What cpuid and XCR0 say this CPU (and OS) supports."""

    avx2: bool
    f16c: bool
    fma: bool
    avx512f: bool
    avx512bw: bool
    avx512vl: bool
    avx512dq: bool
    avx512_bf16: bool
    avx512_fp16: bool
    amx_bf16: bool
    amx_tile: bool

def cpu_features() -> CpuFeatures:
    """This CPU's features (probed once, at import)."""

def default_threads() -> int:
    """The kernels' default thread count: configure()'s (FASTXFER_THREADS), else the CPUs this process may use."""

def _set_stream_stores(on: bool) -> None:
    """Testing hook: non-temporal float32 stores in the kernels on the calling thread."""

def _set_thread_flush_denormals(on: bool) -> bool:
    """Testing hook: set FTZ+DAZ on the calling thread (as TensorFlow's threads do); returns the old state."""

# ---- compression kernels (compression: 'bf16' or 'fp16'; wire arrays are bfloat16 / float16) ---

def compress_into(src: np.ndarray, dst: np.ndarray, compression: str, scale: float = 1.0, threads: int = 0) -> None:
    """dst = round_to_nearest_even(src * scale): float32 in, the 16-bit wire dtype out, same element count."""

def decompress_into(src: np.ndarray, dst: np.ndarray, compression: str, scale: float = 1.0, threads: int = 0) -> None:
    """dst = float32(src) * scale: the 16-bit wire dtype in, float32 out, same element count."""

def accumulate(acc: np.ndarray, src: np.ndarray, compression: str, threads: int = 0) -> None:
    """acc += decompress(src), in float32."""

def sum_compress(a: np.ndarray, b: np.ndarray, out: np.ndarray, compression: str, threads: int = 0) -> None:
    """out = compress(decompress(a) + decompress(b)); out may alias a or b."""

def _reduce_block(op: str, srcs: list[np.ndarray], out: np.ndarray, scale: float = 1.0) -> None:
    """The engine's reduce kernel on equal-sized arrays of one dtype, in list (rank) order (tests)."""

# ---- fusion --------------------------------------------------------------------------------------

class Bucket:
    """A fused bucket planned by BucketPlanner (read-only)."""

    @property
    def dtype(self) -> str:
        """dtype name of every tensor in the bucket."""
    @property
    def compression(self) -> str:
        """How float32 tensors travel: 'none', 'bf16' or 'fp16' ('none' for other dtypes)."""
    @property
    def wire_dtype(self) -> str:
        """dtype name of the packed buffer's elements."""
    @property
    def tensors(self) -> list[int]:
        """Indices into the planner's input, ascending."""
    @property
    def offsets(self) -> list[int]:
        """Element offset of each tensor in the packed buffer."""
    @property
    def numels(self) -> list[int]:
        """Element count of each tensor."""
    @property
    def numel(self) -> int:
        """Elements in the packed buffer, alignment padding included."""
    @property
    def nbytes(self) -> int:
        """Bytes of the packed buffer (numel * wire element size)."""

class BucketPlanner:
    """Groups tensors, in gradient-ready order, into buckets of one dtype under a byte cap on the wire."""

    def __init__(self, cap_bytes: int = ..., first_cap_bytes: int = ..., compression: str = "none") -> None:
        """Caps in bytes after compression (defaults 25 MiB and 1 MiB); ValueError for an unknown compression."""
    @property
    def cap_bytes(self) -> int:
        """The cap of every bucket after the first."""
    @property
    def first_cap_bytes(self) -> int:
        """The cap of the first bucket."""
    @property
    def compression(self) -> str:
        """'none', 'bf16' or 'fp16'."""
    def plan(self, specs: Sequence[tuple[int, str]]) -> list[Bucket]:
        """specs: (numel, dtype name) per tensor in gradient-ready order; the same list plans the same buckets."""

def pack(bucket: Bucket, tensors: Sequence[np.ndarray], out: np.ndarray, scale: float = 1.0, threads: int = 0) -> None:
    """Copy the bucket's tensors into ``out`` (at least bucket.nbytes), scaling and compressing on the way."""

def unpack(bucket: Bucket, buffer: np.ndarray, outs: Sequence[np.ndarray], scale: float = 1.0,
           threads: int = 0) -> None:
    """Split a packed buffer into ``outs`` (one per tensor), decompressing and scaling on the way."""

# ---- output pool (common/output_pool.h, bound in bindings/pool.cc) ---------------------------

def pool_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised, writable, C-contiguous array whose page-aligned memory comes from the output
    pool and returns to it when the array and all its views are gone (``array.base`` holds it)."""

def output_pool_stats() -> dict[str, int]:
    """cap_bytes, cached_bytes, cached_buffers, live_bytes, live_buffers, hits, misses, evictions,
    bad_releases (releases of buffers that were not live: refused)."""

def set_output_pool_cap(bytes: int) -> None:
    """Cap the bytes kept cached (0: cache nothing; configure() sets FASTXFER_OUTPUT_POOL_MB's at import)."""

def output_pool_trim() -> None:
    """Unmap every cached buffer (live arrays are untouched)."""

# ---- the collective engine -------------------------------------------------------------------

class CommStats:
    """Where the collectives' time went, cumulative since init (seconds, counts, bytes on the wire)."""

    pack_s: float
    wait_s: float
    reduce_s: float
    unpack_s: float
    negotiate_s: float
    chunks: int
    rounds: int
    wire_bytes: int
    eager_buckets: int

class Engine:
    """The background collective engine over shared memory (one per process)."""

    def __init__(self, name: str, rank: int, size: int, window_bytes: int, oob_bytes: int, timeout_s: float,
                 attach_timeout_s: float, threads: int, cpus: Sequence[int], bucket_cap_bytes: int,
                 max_records: int, stream_min_bytes: int, inter_host: Any = None, timeline_path: str = "",
                 timeline_rank: int = 0, spin_us: float = 50.0, stall_warning_s: float = 60.0,
                 report_dir: str = "", segment_ranks: Sequence[int] = (), job_ranks: Sequence[int] = (),
                 net_chunk_bytes: int = 1 << 20, host_timeout_s: float = 0.0, yield_on_wake: bool = True,
                 host_id: str = "", clock_offset_us: float = 0.0, timeline_mark_cycles: bool = False,
                 member_pids: Sequence[int] = (), precreated: bool = False, eager_bytes: int = 32 << 10,
                 host_leader: bool = True, eager_tune: bool = True, spin_max_us: float = 1000.0) -> None:
        """Create or attach this host's segment ``name`` and start the engine thread; waits for the other local
        ranks. ``inter_host``: an object with the InterHost methods (fastxfer.comm.mpi.MPIInterHost) for jobs
        that span several hosts. ``stall_warning_s``: a wait this long warns once, naming the rank that stalls;
        ``report_dir``: where stall reports go for the launcher (FASTXFER_REPORT_DIR); ``segment_ranks`` /
        ``job_ranks``: the job rank of each rank of the segment / the engine, for messages; ``net_chunk_bytes``,
        ``host_timeout_s``: several hosts (FASTXFER_NET_CHUNK_MB, FASTXFER_HOST_TIMEOUT); ``yield_on_wake``: a
        submit that wakes the sleeping engine thread yields the core (FASTXFER_YIELD); ``host_id``: this host's
        id when hosts are emulated on one machine (FASTXFER_HOST_ID); ``clock_offset_us``: this rank's
        steady clock to rank 0's, for the timeline; ``timeline_mark_cycles``: an event at every negotiation
        round; ``member_pids``: each rank's pid when the launcher told it (a rank that dies before it attaches
        fails the others at once); ``precreated``: rank 0 opens the segment precreate_segment made; ``eager_bytes``: allreduce buckets up to
        this size travel with the negotiation's records (FASTXFER_EAGER_KB). Every value
        comes from fastxfer.settings: the core reads no environment variable."""
    @property
    def rank(self) -> int:
        """This process's rank in the engine's group."""
    @property
    def size(self) -> int:
        """Number of ranks in the engine's group."""
    @property
    def oob_capacity(self) -> int:
        """The largest oob_allreduce, in bytes."""
    @property
    def running(self) -> bool:
        """Whether the engine thread is still serving requests."""
    @property
    def timeline_enabled(self) -> bool:
        """Whether this rank records its part of the timeline now."""
    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """This rank's part of the job's timeline, written to ``path`` from now on (fastxfer.comm.timeline)."""
    def stop_timeline(self) -> None:
        """Closes this rank's part of the timeline (idempotent)."""
    def submit(self, kind: str, name: str, input: np.ndarray | None, output: np.ndarray | None, op: str = "sum",
               compression: str = "none", root: int = 0, prescale: float = 1.0, postscale: float = 1.0,
               bucket_cap: int = 0, defer: bool = False, splits: list[int] = ...) -> int:
        """Queue a collective ('allreduce', 'broadcast', 'allgather', 'alltoall', 'reducescatter',
        'barrier'); returns its request id. The buffers must stay alive and unchanged until release().
        ``defer``: do not wake the engine thread; the caller waits at once and runs the round itself.
        ``splits``: alltoall's rows per destination rank (empty: an equal split); ValueError when
        they do not fit the tensor."""
    def run(self, kind: str, name: str, input: np.ndarray | None, output: np.ndarray | None, op: str = "sum",
            compression: str = "none", root: int = 0, prescale: float = 1.0, postscale: float = 1.0,
            bucket_cap: int = 0) -> None:
        """A synchronous collective into ``output``: submit, wait (without the GIL) and release in one call;
        raises the request's error."""
    def allreduce_into(self, counter: Iterator[int], prefix: str, input: np.ndarray, output: object, op: str,
                       compression: str, prescale: float, postscale: float, bucket_cap: int) -> bool:
        """``run("allreduce", prefix + str(next(counter)), ...)`` when ``input`` is a C-contiguous ndarray
        and ``output`` what ``_validate.out_like`` accepts for it; False (nothing run, the counter
        untouched) otherwise."""
    def wait(self, id: int) -> None:
        """Block (without the GIL) until the request finishes; raises its error."""
    def done(self, id: int) -> bool:
        """Whether the request has finished."""
    @property
    def tracked(self) -> int:
        """Requests still tracked: queued, running, or finished and not yet waited for."""
    def detach(self, id: int) -> None:
        """Forget request ``id`` once it finishes: nobody will wait for it (its handle was dropped)."""
    def release(self, id: int) -> None:
        """Forget a finished request (its buffers are no longer touched)."""
    def joined_last(self, id: int) -> int:
        """A finished join's result: the rank that joined last."""
    def take_finished(self) -> list[int]:
        """Ids of requests finished since the last call."""
    def take_gathered(self, id: int) -> tuple[np.ndarray, int, list[int]]:
        """An allgather's, alltoall's or reducescatter's result: (raw uint8 bytes, rows along axis 0,
        an alltoall's rows received from each rank, else [])."""
    def oob_allreduce(self, input: np.ndarray, output: np.ndarray, name: str, op: str, postscale: float) -> None:
        """Reduce a small array on the out-of-band lane, on the calling thread (GIL released)."""
    def stats(self) -> CommStats:
        """Where the time went so far (a snapshot)."""
    def eager_tuning(self) -> list[dict[str, object]]:
        """The one-exchange path's tuner: per size class offered so far, its offers, the rounds timed on
        each path, their median round times and the path this rank offers."""
    def set_eager_tuning(self, on: bool) -> None:
        """Off: every bucket within FASTXFER_EAGER_KB takes the one-exchange path, unmeasured."""
    @property
    def host_lost(self) -> bool:
        """A host of the job was lost (heartbeats across hosts): MPI cannot be finalized."""
    def mark(self, name: str) -> None:
        """A step mark on the timeline (FASTXFER_TIMELINE); no-op without one."""
    def make_current(self) -> None:
        """Make this the engine that the TensorFlow op library (the C interface) submits to."""
    def make_process_set_engine(self, process_set_id: int) -> None:
        """Make this the engine of process set `process_set_id` for the TensorFlow op library."""
    def shutdown(self) -> None:
        """Leave the group (collective); stops the engine thread."""
    def leave(self, why: str) -> None:
        """Stop without the peers (not collective): they fail at once if they wait for this rank."""
    def report(self, job_culprit: int, kind: str, msg: str) -> None:
        """Tell `fastxfer run` this rank fails because of job rank ``job_culprit`` (``kind``: stalled,
        finished, failed); the first culprit a rank names stands."""

def clear_current_engine() -> None:
    """Detach the C interface from the engine (shutdown): later native submissions fail cleanly."""
def clear_process_set_engine(process_set_id: int) -> None:
    """Forget process set `process_set_id`'s engine (remove_process_set): its submissions fail cleanly."""
def connect_op_library(path: str) -> None:
    """Hand the already loaded TensorFlow op library at `path` this module's engine interface
    (RuntimeError when it is not loaded or refuses the interface's version)."""
class PlainAllreduce:
    """``engine.allreduce_into(counter, prefix, input, output, op, compression, prescale, postscale,
    bucket_cap)`` with everything but the two arrays bound (the plain-call shortcut of
    ``fastxfer.comm.collectives.allreduce``)."""
    def __init__(self, engine: Engine, counter: Iterator[int], prefix: str, op: str, compression: str,
                 prescale: float, postscale: float, bucket_cap: int) -> None: ...
    def __call__(self, input: np.ndarray, output: object) -> bool:
        """True once the allreduce of ``input`` into ``output`` ran; False (nothing run, the counter
        untouched) when they are not what ``Engine.allreduce_into`` takes."""
    @property
    def engine(self) -> Engine:
        """The engine it submits to."""

def segment_bytes(size: int, window_bytes: int, oob_bytes: int, max_records: int) -> int:
    """The bytes a job segment for `size` ranks with these settings takes in /dev/shm."""
def precreate_segment(name: str, size: int, window_bytes: int, oob_bytes: int, max_records: int) -> None:
    """Create segment ``name`` for ``size`` ranks (exclusively, every page reserved) and leave it for an
    Engine started with ``precreated=True``: a full /dev/shm fails here, before any peer waits for it."""

# ---- topology and placement ------------------------------------------------------------------

class CpuEntry:
    """One logical CPU as sysfs describes it."""

    cpu: int
    socket: int
    core: int
    node: int
    online: bool
    allowed: bool

class NodeEntry:
    """One NUMA node: its CPUs (online or not) and memory."""

    id: int
    cpus: list[int]
    memory_mb: int

class CacheEntry:
    """One cache of the first usable CPU."""

    level: int
    type: str
    size_kb: int

class Isa:
    """The instruction-set features placement and precision depend on."""

    avx2: bool
    f16c: bool
    avx512f: bool
    avx512_bf16: bool
    amx_bf16: bool
    amx_tile: bool

class Topology:
    """The machine (or a snapshot of one) as probe_topology found it."""

    cpus: list[CpuEntry]
    nodes: list[NodeEntry]
    caches: list[CacheEntry]
    isa: Isa
    notes: list[str]
    @property
    def sockets(self) -> int:
        """Sockets with at least one usable CPU."""
    @property
    def cores(self) -> int:
        """Usable physical cores."""
    @property
    def threads_per_core(self) -> int:
        """Most usable SMT siblings on one core."""

class WorkerPlacement:
    """Where one local worker runs and how many threads it uses."""

    local_rank: int
    cpus: list[int]
    mem_nodes: list[int]
    comm_cpus: list[int]
    intra_op_threads: int
    inter_op_threads: int
    numactl: str
    env: dict[str, str]

class Plan:
    """The placement of N workers on a topology."""

    mode: str
    workers: list[WorkerPlacement]
    precision_policy: str

def probe_topology(root: str = "/", live: bool = True) -> Topology:
    """root='/' and live=True: this machine; otherwise a snapshot laid out like / under root (TopologyError
    when malformed)."""

def plan_workers(topology: Topology, workers: int, prefer: str = "socket") -> Plan:
    """The placement of ``workers`` workers ('socket' or 'numa' preferred when the count matches both)."""

def format_cpu_list(cpus: Sequence[int]) -> str:
    """Sorted CPU numbers -> the canonical sysfs form, e.g. '0-3,8'."""

def parse_cpu_list(text: str) -> list[int]:
    """A sysfs-form CPU list -> sorted CPU numbers without repeats (TopologyError when malformed)."""

def bind_cpus(cpus: Sequence[int]) -> None:
    """Restrict this process (and what it execs) to ``cpus`` (sched_setaffinity)."""

def bind_memory(nodes: Sequence[int]) -> None:
    """Bind this process's memory to NUMA ``nodes`` (set_mempolicy MPOL_BIND)."""

# ---- input pipeline ----------------------------------------------------------------------------

def jpeg_support() -> tuple[bool, str]:
    """(built, note): whether this build has the ROI JPEG decoder, and why not."""

class TileLayout:
    """The MCU grid of a tiled JPEG."""

    height: int
    width: int
    mcu_h: int
    mcu_w: int
    rows: int
    cols: int
    subsampled: bool

def jpeg_tile_layout(data: bytes | bytearray | memoryview | np.ndarray) -> TileLayout | None:
    """The MCU grid of a tiled JPEG (a restart marker after every MCU), or None for any other data."""

def jpeg_tile_crop(data: bytes | bytearray | memoryview | np.ndarray, r0: int, r1: int, c0: int, c1: int) -> bytes:
    """The JPEG of MCU rows [r0, r1) and columns [c0, c1) of a tiled JPEG."""

def resize_normalize(img: np.ndarray, y0: int, x0: int, ch: int, cw: int, out: np.ndarray, flip: bool,
                     brightness: float, contrast: float, saturation: float, mean: np.ndarray,
                     std: np.ndarray) -> None:
    """Crop + resize + flip + jitter + normalise one uint8 HxWxC image into out (float32 or bfloat16, oh x ow x 3)."""

class JpegBatchDecoder:
    """Region-of-interest JPEG decode fused with crop/resize/normalise, on its own threads."""

    def __init__(self, library_path: str, threads: int = 0, max_pixels: int = 1 << 28) -> None:
        """Open libjpeg-turbo at ``library_path``; RuntimeError naming the path when it cannot."""
    @property
    def library_path(self) -> str:
        """The libjpeg-turbo this decoder uses."""
    @property
    def threads(self) -> int:
        """Decoding threads."""
    def transcode(self, data: bytes | bytearray | memoryview | np.ndarray) -> bytes:
        """Lossless transcode of a JPEG to fastxfer's tiled form (a restart marker after every MCU)."""
    def set_decode_only(self, on: bool) -> None:
        """Benchmark switch: decode the rows each crop needs and drop them (out is not written)."""
    def set_tiles(self, on: bool) -> None:
        """False decodes tiled records by region of interest, as untiled ones (tests and benchmarks)."""
    def decode_batch(self, records: Sequence[bytes | bytearray | memoryview | np.ndarray], heights: np.ndarray,
                     widths: np.ndarray, boxes: np.ndarray, flips: np.ndarray, jitter: np.ndarray, mean: np.ndarray,
                     std: np.ndarray, out: np.ndarray) -> list[str]:
        """Decode records[i] cropped to boxes[i] (y, x, h, w) into out[i]; one message per image ('' when written)."""
