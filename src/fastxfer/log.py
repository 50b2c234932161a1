"""The `fastxfer` logger: everything the library says that is not an answer to a command.

Its level comes from FASTXFER_LOG_LEVEL (or Horovod's HOROVOD_LOG_LEVEL; default warning), read at
import and again at ``init()``. The native core's own messages follow the same level
(``_core.set_log_level``). Records carry the job rank once ``init()`` has it, and the one given by
the launcher's variables before that. An application that configures logging (a handler on the
root logger, or on ``fastxfer``) gets the records through its own handlers. Otherwise fastxfer
prints them on stderr as ``fastxfer[rank 1] WARNING: ...``. ``warnings.warn`` is kept for API
misuse: deprecated arguments, arguments that change nothing.
"""

from __future__ import annotations

import logging
import os
import sys

from fastxfer import _core, settings

logger = logging.getLogger("fastxfer")
FORMAT = "fastxfer[rank %(fastxfer_rank)s] %(levelname)s: %(message)s"
_rank: int | None = None
# where the launchers put the rank before init() (fastxfer run, horovodrun, mpirun, srun, torchrun)
_RANK_VARIABLES = ("FASTXFER_RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "RANK")


def set_rank(rank: int | None) -> None:
    """The job rank records are stamped with (init() sets it; None: from the launcher's variables)."""
    global _rank
    _rank = rank


def _current_rank() -> str:
    if _rank is not None:
        return str(_rank)
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return value
    return "-"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.fastxfer_rank = _current_rank()
        return True


class _Fallback(logging.StreamHandler):
    """stderr, in fastxfer's format, only while nobody configured logging: the records still reach
    the application's own handlers, and are never printed twice."""

    def emit(self, record: logging.LogRecord) -> None:
        root = logging.getLogger()
        if root.handlers or any(h is not self for h in logger.handlers):
            return
        self.stream = sys.stderr  # whatever stderr is now (pytest's capture, a redirect)
        super().emit(record)


_fallback = _Fallback()
_fallback.setFormatter(logging.Formatter(FORMAT))


def configure() -> int:
    """Apply FASTXFER_LOG_LEVEL to the logger and to the native core; returns the level."""
    level = logging.getLevelName(settings.get("FASTXFER_LOG_LEVEL").upper())
    logger.setLevel(level)
    _core.set_log_level(level)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    if _fallback not in logger.handlers:
        logger.addHandler(_fallback)
    return level
