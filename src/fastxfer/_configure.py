"""The native core's process-wide settings, handed to it once, at import (fastxfer/__init__.py):
the kernel path (FASTXFER_SIMD), the kernels' default thread count (FASTXFER_THREADS) and the
output pool's cap (FASTXFER_OUTPUT_POOL_MB), read through fastxfer.settings. The C++ core reads no
environment variable; per-job values reach it in the engine's job configuration at init()
(comm/group.py)."""

from __future__ import annotations

from fastxfer import _core, settings


def configure_core() -> None:
    """Apply the three settings; SettingError (the import fails) for a bad value, or for a kernel
    path this CPU cannot run."""
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
