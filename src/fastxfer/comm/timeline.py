"""The job's timeline: one Chrome-trace file (chrome://tracing, ui.perfetto.dev) with a row per rank
on a common clock, as Horovod's HOROVOD_TIMELINE gives.

Each rank's engine records its own part (csrc/engine/timeline.h: negotiation rounds, buckets with
their wire format, and per tensor: queued, wait, the collective itself) into a private temporary
file, its times on CLOCK_MONOTONIC plus the rank's offset to rank 0's clock (zero on one host,
where every process reads the same clock; measured over MPI at init across hosts, comm/group.py).
When the timeline stops -- ``stop()``, or at shutdown -- every rank sends its part to rank 0 (an
alltoall that carries data to rank 0 only), which writes the one file, times shifted to start at
zero. If the job cannot gather (a peer died), each rank keeps its own part beside the file as
NAME.rank<r>.EXT, so nothing recorded is lost.

It starts at init when FASTXFER_TIMELINE (or HOROVOD_TIMELINE, or horovodrun's
--timeline-filename) names a file, or at run time with ``start(path, mark_cycles)``
(hvd.start_timeline); every rank calls start and stop, as every rank runs the script.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from fastxfer import log as fxlog
from fastxfer import _safefile
from fastxfer import settings as config
from fastxfer.comm import collectives, group
from fastxfer.errors import FastxferError

_state: dict = {}  # path: the job's file; part: this rank's part; folder: the part's private folder


def running() -> bool:
    """Whether this rank records a timeline now."""
    return bool(_state)


def start(path: str, mark_cycles: bool = False) -> None:
    """Starts recording the job's timeline into ``path`` (written by rank 0 when it stops). Every rank
    calls it. ValueError when a timeline is already running or ``path`` cannot be a file."""
    eng = group.engine()
    if _state:
        raise ValueError(f"a timeline is already being recorded (into {_state['path']}): stop_timeline() first")
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    if os.path.isdir(path) or not os.path.isdir(folder):
        raise ValueError(f"timeline file {path}: expected a file in an existing folder")
    private = tempfile.mkdtemp(prefix="fastxfer-timeline-")  # mode 0700: no other user plants a link here
    part = os.path.join(private, f"rank{group.rank()}.json")
    try:
        eng.start_timeline(part, bool(mark_cycles))
    except Exception:
        shutil.rmtree(private, ignore_errors=True)
        raise
    _state.update(path=path, part=part, folder=private)


def stop() -> str | None:
    """Stops recording; rank 0 writes the job's file. Every rank calls it (a collective). Returns the
    file's path (on every rank), None when no timeline was running."""
    if not _state:
        return None
    path, part, folder = _state["path"], _state["part"], _state["folder"]
    _state.clear()
    eng = group.engine()
    eng.stop_timeline()
    try:
        with open(part, "rb") as f:
            mine = np.frombuffer(f.read(), np.uint8)
        size, rank = group.size(), group.rank()
        splits = [mine.size] + [0] * (size - 1)
        try:
            got, counts = collectives.alltoall(mine, splits=splits, name="fastxfer.timeline")
        except FastxferError as e:
            keep = _beside(path, rank)
            _safefile.copy(part, keep, private=True)
            fxlog.logger.error("the timeline could not be gathered (%s); rank %d's part is in %s", e, rank, keep)
            return None
        if rank == 0:
            parts, at = [], 0
            for n in np.asarray(counts).tolist():
                parts.append(got[at:at + n].tobytes())
                at += n
            write_merged(path, parts)
        return path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _beside(path: str, rank: int) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def parse_part(data: bytes) -> list[dict]:
    """One rank's events from its part (a JSON array, closed or not: a part cut short by a crash)."""
    text = data.decode("utf-8", errors="replace").strip()
    if not text:
        return []
    if not text.endswith("]"):
        text = text.rstrip(",\n ") + "\n]"
    return json.loads(text)


def write_merged(path: str, parts: list[bytes]) -> None:
    """The job's one trace from every rank's part, times shifted to start at zero; written to a
    temporary file beside ``path`` and renamed over it (fastxfer/_safefile.py: a link planted at
    ``path`` is replaced, never followed), mode 0600."""
    events = [e for data in parts for e in parse_part(data)]
    times = [e["ts"] for e in events if "ts" in e]
    t0 = min(times) if times else 0.0
    for e in events:
        if "ts" in e:
            e["ts"] = round(e["ts"] - t0, 3)
    # not world-readable: tensor names and timings (docs/reliability.md)
    _safefile.write(path, "[\n" + ",\n".join(json.dumps(e, separators=(", ", ": ")) for e in events) + "\n]\n",
                    private=True)


def _start_from_settings() -> None:
    path = config.get("FASTXFER_TIMELINE")
    if path:
        start(path, config.get("FASTXFER_TIMELINE_MARK_CYCLES"))


def _stop_at_shutdown() -> None:
    if _state:
        stop()


group.on_engine_started(_start_from_settings)
group.before_shutdown(_stop_at_shutdown)
