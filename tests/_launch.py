"""Helpers to run workers through the real launcher."""

import os
import shutil
import subprocess
import sys

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")


def fastxfer_cmd():
    exe = shutil.which("fastxfer")
    return [exe] if exe else [sys.executable, "-m", "fastxfer.cli"]


def launch(np_, worker, *args, env=None, timeout=300, launcher_args=(), cwd=None):
    """`fastxfer run -np N -- python workers/<worker> args...`; returns the CompletedProcess."""
    full_env = dict(os.environ)
    # small window and bucket cap, so modest sizes already stream through several chunks/buckets
    full_env.setdefault("FASTXFER_SHM_WINDOW_MB", "0.25")
    full_env.setdefault("FASTXFER_BUCKET_CAP_MB", "0.5")
    full_env.setdefault("FASTXFER_STREAM_MIN_MB", "0.001")  # exercise the streaming-store paths too
    full_env.update(env or {})
    cmd = fastxfer_cmd() + ["run", "-np", str(np_), *launcher_args, "--", sys.executable,
                            os.path.join(WORKERS, worker), *map(str, args)]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=cwd or "/")


def fastxfer_segments():
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("fastxfer-"))
    except FileNotFoundError:
        return []
