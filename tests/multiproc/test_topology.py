"""Binding on the live machine: `fastxfer run --bind numa` gives each rank its CPUs, its memory
policy and its thread settings, and keeps the user's own settings."""

import os
import sys

import pytest

from _launch import launch

from fastxfer import topology

MPOL_CHECK = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
mode = ctypes.c_int(-1)
mask = (ctypes.c_ulong * 16)()
rc = libc.syscall(239, ctypes.byref(mode), mask, ctypes.c_ulong(1024), ctypes.c_void_p(0), ctypes.c_ulong(0))
print("BOUND", os.environ["FASTXFER_RANK"], sorted(os.sched_getaffinity(0)), "mode", mode.value, "mask", mask[0],
      "omp", os.environ.get("OMP_NUM_THREADS"), "user", os.environ.get("KMP_BLOCKTIME"))
"""


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="syscall number is x86-64's")
def test_bind_takes_effect_on_the_live_machine():
    allowed = sorted(os.sched_getaffinity(0))
    n = min(2, len(allowed))
    plan = topology.plan(n, prefer="numa")["workers"]
    r = launch(n, "-c", MPOL_CHECK, launcher_args=["--bind", "numa"], timeout=120,
               env={"KMP_BLOCKTIME": "7"})  # a user's own setting is kept
    assert r.returncode == 0, r.stderr
    for w in plan:
        want = topology.parse_cpu_list(w["cpus"])
        nodes_mask = sum(1 << m for m in w["mem_nodes"])
        line = f"BOUND {w['local_rank']} {want} mode 2 mask {nodes_mask} omp {w['intra_op_threads']} user 7"
        assert line in r.stdout, r.stdout
        assert f"rank {w['local_rank']}: {w['numactl']}" in r.stderr
