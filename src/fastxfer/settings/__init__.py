"""Every ``FASTXFER_*`` environment variable fastxfer reads, declared once, in one table.

NCCL's ``NCCL_PARAM`` habit: each setting is declared here with its type, the values it accepts,
its default, what it means and who sets it (the user, or the launcher for its workers); nothing
else in the package reads a ``FASTXFER_*`` variable from the environment, and the C++ core reads
none at all (its values arrive through ``_core.configure`` at import and the engine's job
configuration at ``init()``: docs/architecture.md, "Settings"). docs/configuration.md is generated
from this table (``python -m fastxfer.settings --markdown``: __main__.py).

- ``get(name)``: the parsed, validated value of one setting, read from ``os.environ`` at the call
  (the default when it is unset or empty);
- ``validate_all()``: every declared setting that is set, checked (``fastxfer.init()`` calls it
  first, so a bad value is one clear error there, never a traceback from deep inside);
- ``SettingError``: one line naming the variable, the bad value and the values accepted.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping

from fastxfer._validate import BUCKET_CAP_MB_RANGE
from fastxfer.errors import FastxferError
from fastxfer.settings import horovod

USER = "user"
LAUNCHER = "launcher"  # `fastxfer run` sets it for its workers


class SettingError(FastxferError, ValueError):
    """A ``FASTXFER_*`` variable holds a value fastxfer does not accept. The message is one line:
    ``FASTXFER_THREADS='abc': expected an integer between 1 and 4096 (threads of the native kernels)``.
    (A ValueError, and a FastxferError like every error of fastxfer's own.)"""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One declared variable. ``type`` is int, float, bool, switch (a bool or ``auto``), choice or
    text; numbers are checked against ``low``/``high`` (``low_open``: strictly above ``low``), text
    by ``check`` (which returns the value to use or raises ValueError)."""

    name: str
    type: str
    default: object
    meaning: str
    bad: str  # one value that is refused (tests/unit/test_settings.py tries each)
    set_by: str = USER
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    check: Callable[[str], object] | None = None
    accepted_text: str = ""  # the accepted values in words, where the type alone does not say them
    default_text: str = ""  # the default in words, where it is not a plain value
    default_from: str = ""  # unset: the value of this other setting
    secret: bool = False  # the value is never repeated in a message

    def accepted(self) -> str:
        """The values accepted, in words (what a SettingError says after "expected")."""
        if self.accepted_text:
            return self.accepted_text
        if self.type in ("int", "float"):
            what = "an integer" if self.type == "int" else "a number"
            if self.high is None:
                return f"{what} {'>' if self.low_open else '>='} {_num(self.low)}"
            if self.low_open:
                return f"{what} > {_num(self.low)} and <= {_num(self.high)}"
            return f"{what} between {_num(self.low)} and {_num(self.high)}"
        if self.type == "bool":
            return "1 or 0 (or true/false, yes/no, on/off)"
        if self.type == "switch":
            return "1, 0 or auto (or true/false, yes/no, on/off)"
        if self.type == "choice":
            return "one of " + ", ".join(self.choices)
        raise AssertionError(f"{self.name}: a text setting needs accepted_text")

    def default_in_words(self) -> str:
        if self.default_text:
            return self.default_text
        if self.default_from:
            return f"`{self.default_from}`"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if self.default is None or self.default == "":
            return "unset"
        return f"`{_num(self.default) if isinstance(self.default, float) else self.default}`"

    def parse(self, raw: str):
        """The value of ``raw`` (non-empty, as the environment holds it); SettingError when refused."""
        text = raw.strip()
        try:
            if self.type == "int":
                if not re.fullmatch(r"[+-]?[0-9]+", text):
                    raise ValueError
                return self._in_range(int(text))
            if self.type == "float":
                value = float(text)  # ValueError for garbage
                if not math.isfinite(value):
                    raise ValueError
                return self._in_range(value)
            if self.type in ("bool", "switch"):
                low = text.lower()
                if low in _TRUE:
                    return True
                if low in _FALSE:
                    return False
                if self.type == "switch" and low == "auto":
                    return "auto"
                raise ValueError
            if self.type == "choice":
                if text.lower() not in self.choices:
                    raise ValueError
                return text.lower()
            return self.check(text) if self.check else text
        except ValueError:
            shown = f"<{len(raw)} characters, not shown>" if self.secret else repr(raw)
            raise SettingError(f"{self.name}={shown}: expected {self.accepted()} ({self.meaning})") from None

    def _in_range(self, value):
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            raise ValueError
        if self.high is not None and value > self.high:
            raise ValueError
        return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _num(x) -> str:
    if x == BUCKET_CAP_MB_RANGE[0]:
        return "1/1024"
    if isinstance(x, float):
        return str(int(x)) if x.is_integer() else f"{x:g}"
    return str(x)


# ---- checks of text values (each returns the value to use, or raises ValueError) -------------

def _cpu_list(text: str) -> list[int]:
    # The native parser, the one sysfs files and --cpus go through too: one grammar for every CPU list.
    from fastxfer import _core

    try:
        cpus = list(_core.parse_cpu_list(text))
    except Exception:  # noqa: BLE001 - the native parser's TopologyError: refused, whatever the detail
        raise ValueError from None
    if not cpus:
        raise ValueError
    return cpus


def _absolute_path(text: str) -> str:
    if not os.path.isabs(text):
        raise ValueError
    return text


def _existing_directory(text: str) -> str:
    if not os.path.isabs(text) or not os.path.isdir(text):
        raise ValueError
    return os.path.normpath(text)


def _file_path(text: str) -> str:
    if text.endswith("/") or os.path.isdir(text):
        raise ValueError
    return text


def _label(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._:@+-]{1,128}", text):
        raise ValueError
    return text


def _job_id(text: str) -> str:
    if not re.fullmatch(r"[0-9]+-\S+", text):
        raise ValueError
    return text


def _job_secret(text: str) -> str:
    if len(text) < 32 or re.search(r"\s", text):
        raise ValueError
    return text


_MB = "MiB"

# The table: user settings first (by area), then what the launcher sets for its workers.
_TABLE: tuple[Setting, ...] = (
    # -- kernels and memory (applied at import) --
    Setting("FASTXFER_SIMD", "choice", None, "the kernel path, forced at import; only a path this CPU supports",
            "avx9000", choices=("scalar", "avx2", "avx512", "avx512bf16"),
            default_text="the best path this CPU supports"),
    Setting("FASTXFER_THREADS", "int", None, "threads of the native kernels when a call passes none", "abc",
            low=1, high=4096, default_text="the CPUs this process may run on (its affinity mask)"),
    Setting("FASTXFER_OUTPUT_POOL_MB", "float", 256.0,
            f"{_MB} of freed result buffers the output pool keeps for reuse, 0: none", "5MB", low=0, high=1e9),
    # -- the engine and the job (read by init()) --
    Setting("FASTXFER_TIMEOUT", "float", 300.0,
            "seconds a peer may stay silent before the others raise PeerFailureError; init(timeout=) wins", "nan",
            low=0, low_open=True),
    Setting("FASTXFER_ATTACH_TIMEOUT", "float", 120.0,
            "seconds init() waits for every rank of the host to attach to the shared-memory segment", "0",
            low=0, low_open=True),
    Setting("FASTXFER_STALL_WARNING_S", "float", None,
            "seconds a wait for a peer lasts before the engine warns once, naming the rank that stalls", "-5",
            low=0, low_open=True, default_text="half the timeout, at most 60"),
    Setting("FASTXFER_BUCKET_CAP_MB", "float", 25.0,
            f"fusion bucket cap in {_MB}, the same on every rank; init(bucket_cap_mb=) wins", "100000",
            low=BUCKET_CAP_MB_RANGE[0], high=BUCKET_CAP_MB_RANGE[1]),
    Setting("FASTXFER_SHM_WINDOW_MB", "float", 16.0,
            f"each rank's staging window in the host's shared-memory segment, {_MB}", "0",
            low=0, low_open=True, high=4096),
    Setting("FASTXFER_OOB_KB", "float", 1024.0, "capacity of the out-of-band lane for small metric tensors, KiB", "-1",
            low=0, low_open=True, high=1 << 20),
    Setting("FASTXFER_STREAM_MIN_MB", "float", 4.0,
            f"buckets whose outputs reach this many {_MB} are written with streaming stores", "-1", low=0, high=1e6),
    Setting("FASTXFER_SPIN_US", "float", 50.0, "microseconds a wait for a peer spins before it sleeps, 0: sleeps at once",
            "1e9", low=0, high=1e6),
    Setting("FASTXFER_SPIN_MAX_US", "float", 1000.0,
            "the most a synchronous call's wait spins once waits that slept and ended soon after show that "
            "spinning pays (from FASTXFER_SPIN_US, back after a long wait; one host with a core per rank only); "
            "at or below FASTXFER_SPIN_US: always FASTXFER_SPIN_US", "-1", low=0, high=1e6),
    Setting("FASTXFER_EAGER_KB", "float", 32.0,
            "allreduce buckets up to this many KiB (packed, at most 64) travel with the negotiation's records: "
            "one exchange between ranks instead of three; 0: never", "-1", low=0, high=64),
    Setting("FASTXFER_EAGER_TUNE", "bool", True,
            "1: below FASTXFER_EAGER_KB the engine times both paths per size and takes the faster; "
            "0: every such bucket takes the one-exchange path", "maybe"),
    Setting("FASTXFER_ENGINE_THREADS", "int", 1, "pack/unpack threads inside one chunk of a collective", "0",
            low=1, high=256),
    Setting("FASTXFER_ENGINE_CPUS", "text", None,
            "the CPUs the engine thread is pinned to; init(engine_cpus=) wins, `fastxfer run --bind` sets it per worker",
            "3-1", check=_cpu_list, accepted_text="a CPU list like 3 or 0-1,8 (sysfs cpulist form)",
            default_text="unpinned"),
    Setting("FASTXFER_YIELD", "bool", True, "a submit that wakes the sleeping engine thread yields the core to it",
            "maybe"),
    Setting("FASTXFER_TIMELINE", "text", "",
            "record the job's timeline from init(): one Chrome trace of every tensor, a row per rank, written to this file by rank 0 at shutdown", "/",
            check=_file_path, accepted_text="a file path (not a directory)", default_text="no timeline"),
    Setting("FASTXFER_TIMELINE_MARK_CYCLES", "bool", False,
            "mark every negotiation round of the engine on the timeline (horovodrun --timeline-mark-cycles)", "maybe"),
    Setting("FASTXFER_LOG_LEVEL", "choice", "warning", "the level of the `fastxfer` logger and of the native core's messages", "loud",
            choices=("debug", "info", "warning", "error", "critical")),
    Setting("FASTXFER_SHM_DIR", "text", "/dev/shm", "the directory of the shared-memory segments, on a tmpfs",
            "shm", check=_existing_directory, accepted_text="the absolute path of an existing directory"),
    # -- several hosts --
    Setting("FASTXFER_HOST_ID", "text", None,
            "this host's identity, for containers that share a boot id across machines and tests that emulate hosts", "two words",
            check=_label, accepted_text="a label of at most 128 letters, digits and ._:@+-",
            default_text="host name + kernel boot id"),
    Setting("FASTXFER_HOST_TIMEOUT", "float", 5.0,
            "several hosts: seconds without heartbeats before a host is lost, 0: no heartbeats", "soon",
            low=0, high=1e6),
    Setting("FASTXFER_NATIVE_MPI", "bool", True,
            "several hosts: call MPI's C API from the engine (no Python, no GIL); 0: through mpi4py, as before",
            "maybe"),
    Setting("FASTXFER_HOST_LEADER", "bool", True,
            "several hosts: the host's first rank alone takes part in each agreement round across hosts and tells "
            "the host's other ranks the verdict through shared memory; 0: every rank talks to its counterparts",
            "maybe"),
    Setting("FASTXFER_NET_SMALL_KB", "float", 64.0,
            "several hosts: an allreduce shard crosses in one round (each host sends all of it to every other) "
            "while that sends at most this much, else as a reduce-scatter and an allgather", "-1", low=0, high=1 << 20),
    Setting("FASTXFER_NET_CHUNK_MB", "float", 1.0,
            f"several hosts: allreduce chunk on the wire, {_MB}, overlapped with the next one's "
            "shared-memory stages; 0: no overlap", "-1", low=0, high=4096),
    # -- the launcher's user settings --
    Setting("FASTXFER_GRACE", "float", 10.0,
            "seconds `fastxfer run` gives the other workers to stop after one fails; --grace wins", "-1", low=0),
    Setting("FASTXFER_ELASTIC_TIMEOUT", "float", None,
            "seconds an elastic launcher waits at the rendezvous for a member after a failure before it kills it "
            "as stalled", "0", low=0, low_open=True, default_from="FASTXFER_TIMEOUT"),
    # -- data --
    Setting("FASTXFER_LOADER_THREADS", "int", None, "decode threads of fastxfer.data.Loader; threads= wins", "0",
            low=1, high=4096, default_text="the CPUs this process may run on"),
    Setting("FASTXFER_LIBJPEG", "text", None, "the libjpeg-turbo shared library the native JPEG decoder opens", "/",
            check=_file_path, accepted_text="a library's path or name (not a directory)",
            default_text="Pillow's bundled libjpeg-turbo, else the system's"),
    Setting("FASTXFER_NO_JIT", "bool", False, "run the Numba reference kernels as plain Python, for debugging",
            "sometimes"),
    # -- TensorFlow --
    Setting("FASTXFER_TF_NATIVE", "bool", True, "use the native TensorFlow op library; 0: the tf.numpy_function bridge",
            "maybe"),
    Setting("FASTXFER_TF_PIN", "switch", "auto",
            "pin TensorFlow submits into the backward pass: always, never, or when the engine has a core of its own",
            "sometimes"),
    Setting("FASTXFER_TF_HOLD", "bool", True,
            "hold a grouped allreduce's small gradients to negotiate a run of them in one round; read at tracing",
            "2"),
    # -- set by the launcher for its workers --
    Setting("FASTXFER_RANK", "int", None, "this worker's rank in the job", "-1", set_by=LAUNCHER, low=0),
    Setting("FASTXFER_SIZE", "int", None, "the number of workers in the job", "0", set_by=LAUNCHER, low=1),
    Setting("FASTXFER_LOCAL_RANK", "int", None, "this worker's rank among the workers of its host", "x",
            set_by=LAUNCHER, low=0),
    Setting("FASTXFER_LOCAL_SIZE", "int", None, "the number of workers on this host", "0", set_by=LAUNCHER, low=1),
    Setting("FASTXFER_JOB_ID", "text", None, "the job's name: the launcher's pid, a dash, a tag", "job7",
            set_by=LAUNCHER, check=_job_id, accepted_text="<launcher pid>-<tag>"),
    Setting("FASTXFER_JOB_SECRET", "text", None, "the per-job secret the segment names derive from", "short",
            set_by=LAUNCHER, check=_job_secret, secret=True,
            accepted_text="at least 32 characters without spaces (`fastxfer run` sets 64 hex digits)"),
    Setting("FASTXFER_REPORT_DIR", "text", None, "the launcher's private folder for stall reports", "reports",
            set_by=LAUNCHER, check=_absolute_path, accepted_text="an absolute path"),
    Setting("FASTXFER_ELASTIC_SOCKET", "text", None, "the elastic launcher's rendezvous socket", "rdzv.sock",
            set_by=LAUNCHER, check=_absolute_path, accepted_text="an absolute path"),
    Setting("FASTXFER_WORKER_ID", "int", None, "an elastic worker's identity, kept across generations", "w1",
            set_by=LAUNCHER, low=0),
    Setting("FASTXFER_INTRA_OP_THREADS", "int", None,
            "TensorFlow's intra-op threads from the placement plan of `fastxfer run --bind`", "0",
            set_by=LAUNCHER, low=1, high=4096),
    Setting("FASTXFER_INTER_OP_THREADS", "int", None,
            "TensorFlow's inter-op threads from the placement plan of `fastxfer run --bind`", "0",
            set_by=LAUNCHER, low=1, high=4096),
)

_BY_NAME: dict[str, Setting] = {s.name: s for s in _TABLE}
assert len(_BY_NAME) == len(_TABLE), "a setting declared twice"


def table() -> tuple[Setting, ...]:
    """Every declared setting, in the order of docs/configuration.md."""
    return _TABLE


def declaration(name: str) -> Setting:
    """The declaration of ``name``; KeyError for a name that is not declared."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared fastxfer setting (fastxfer/settings.py)") from None


def get(name: str, environ: Mapping[str, str] | None = None):
    """The value of setting ``name`` from ``environ`` (default: ``os.environ``, read now): parsed and
    validated, the default when it is unset or empty. SettingError when the value is refused."""
    s = declaration(name)
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        try:
            alias = horovod.alias_value(name, env)
        except ValueError as e:  # the Horovod variable's own value is refused
            raise SettingError(f"{e}={env.get(str(e))!r} (Horovod's, for {name}): expected {s.accepted()} "
                               f"({s.meaning})") from None
        if alias is not None:
            try:
                return s.parse(alias[1])
            except SettingError:
                raise SettingError(f"{alias[0]}={env.get(alias[0])!r} (Horovod's, for {name}): expected "
                                   f"{s.accepted()} ({s.meaning})") from None
        return get(s.default_from, env) if s.default_from else s.default
    return s.parse(raw)


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` is set to something other than blanks (a blank value means the default)."""
    declaration(name)
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is not None and raw.strip() != "":
        return True
    try:
        return horovod.alias_value(name, env) is not None  # set through its Horovod name
    except ValueError:
        return True  # set, to a bad value: get() says so


def validate_all(environ: Mapping[str, str] | None = None) -> dict:
    """Check every declared setting that is set; SettingError for the first refused value, in the
    table's order. Returns {name: value} of those that are set."""
    env = os.environ if environ is None else environ
    return {s.name: get(s.name, env) for s in _TABLE if is_set(s.name, env)}


def undeclared(environ: Mapping[str, str] | None = None) -> list[str]:
    """``FASTXFER_*`` variables that are set but not declared here (a typo, or a setting of
    another version): fastxfer reads none of them."""
    env = os.environ if environ is None else environ
    return sorted(n for n in env if n.startswith("FASTXFER_") and n not in _BY_NAME)


def markdown() -> str:
    """docs/configuration.md, generated from the table."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "# Configuration: environment variables",
        "",
        "<!-- Generated from src/fastxfer/settings/__init__.py by `python -m fastxfer.settings --markdown`; "
        "tests/unit/test_settings.py fails when the two differ. Edit the table there, not this file. -->",
        "",
        "Every `FASTXFER_*` variable fastxfer reads is declared once, in `fastxfer.settings`, and listed",
        "here. `fastxfer.init()` checks every one that is set before it does anything else: a value",
        "outside what is accepted is one `fastxfer.settings.SettingError` (a `ValueError`) naming the",
        "variable, the value and what is accepted, never a traceback from deep inside and never silently",
        "ignored. An empty value means the default. The kernel settings (`FASTXFER_SIMD`,",
        "`FASTXFER_THREADS`, `FASTXFER_OUTPUT_POOL_MB`) are applied when `fastxfer` is imported, and a bad",
        "one fails the import. The C++ core reads no environment variable: Python hands it these values",
        "(docs/architecture.md, \"Settings\").",
        "",
    ]
    for who, title in ((USER, "Settings"), (LAUNCHER, "Set by the launcher for its workers")):
        lines += [f"## {title}", "",
                  "| variable | accepted | default | meaning |",
                  "|---|---|---|---|"]
        for s in _TABLE:
            if s.set_by == who:
                lines.append(f"| `{s.name}` | {cell(s.accepted())} | {cell(s.default_in_words())} | {cell(s.meaning)} |")
        lines.append("")
    lines += ["## Horovod's variables", "",
              "A Horovod variable that stands for a setting is honoured when that setting itself is unset; one",
              "that changes nothing here is named, with the reason, in one warning at `init()`. The variables",
              "horovodrun sets to say where a worker sits (`HOROVOD_RANK`, `_SIZE`, `_LOCAL_RANK`, ...) are read",
              "by the launcher table (docs/launchers.md).", "",
              "| variable | here |", "|---|---|"]
    for v in horovod.TABLE:
        lines.append(f"| `{v.name}` | {cell(v.meaning)}{f' (`{v.setting}`)' if v.setting else ''} |")
    lines.append("")
    return "\n".join(lines)
