"""The native core's process-wide settings, handed to it once, at import (fastxfer/__init__.py):
the kernel path (FASTXFER_SIMD), the kernels' default thread count (FASTXFER_THREADS) and the
output pool's cap (FASTXFER_OUTPUT_POOL_MB), read through fastxfer.settings. The C++ core reads no
environment variable; per-job values reach it in the engine's job configuration at init()
(comm/group.py)."""

from __future__ import annotations

import os
import sys

from fastxfer import _core, settings


def configure_core() -> None:
    """Apply the three settings; SettingError (the import fails) for a bad value, or for a kernel
    path this CPU cannot run. Left uncaught, that error ends the program with its one line and
    exit code 2 -- a `fastxfer` command fails the way its own check of the settings does -- and
    no traceback (``exit_quietly_if_uncaught``)."""
    try:
        _configure()
    except settings.SettingError as e:
        exit_quietly_if_uncaught(e)
        raise


def exit_quietly_if_uncaught(error: BaseException) -> None:
    """If ``error`` reaches the top level uncaught, print ``fastxfer: <message>`` and exit with 2
    instead of a traceback: a bad environment variable is the user's to fix, not a bug."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if value is error:
            sys.stdout.flush()
            print(f"fastxfer: {value}", file=sys.stderr, flush=True)
            os._exit(2)  # an uncaught exception would exit with 1; the command line's promise is 2
        previous(kind, value, tb)

    sys.excepthook = hook


def _configure() -> None:
    from fastxfer import log

    log.configure()  # FASTXFER_LOG_LEVEL: the `fastxfer` logger's level, and the native core's
    level = settings.get("FASTXFER_SIMD")
    threads = settings.get("FASTXFER_THREADS")
    pool_mb = settings.get("FASTXFER_OUTPUT_POOL_MB")
    try:
        _core.configure(simd_level=level or "", threads=threads or 0,
                        output_pool_cap_bytes=int(pool_mb * (1 << 20)))
    except ValueError:  # the only value the core can refuse: a path this CPU does not have
        have = ", ".join(_core.supported_simd_levels())
        raise settings.SettingError(f"FASTXFER_SIMD={level!r}: expected a path this CPU supports, one of {have} "
                                    f"({settings.declaration('FASTXFER_SIMD').meaning})") from None
