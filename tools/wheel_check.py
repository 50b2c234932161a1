"""The test a built wheel must pass in a fresh environment (cibuildwheel's test-command, and
tools/build_wheel.sh): the package imports, its native core loads, and a 2-rank allreduce through
`fastxfer run` gives exact sums. Exit code 0 when it does."""

import os
import subprocess
import sys
import tempfile

WORKER = r"""
import numpy as np
import fastxfer as fx

fx.init()
r, n = fx.rank(), fx.size()
x = np.arange(1000, dtype=np.float32) * (r + 1)
y = fx.allreduce(x, op="sum")
assert n == 2 and np.array_equal(y, np.arange(1000, dtype=np.float32) * 3), y[:4]
h = fx.allreduce(np.full(7, r + 1, np.int64), op="sum")
assert h.tolist() == [3] * 7, h
fx.shutdown()
print(f"rank {r}: allreduce exact", flush=True)
"""


def main() -> int:
    import fastxfer
    from fastxfer import _core

    print(f"fastxfer {fastxfer.__version__} from {os.path.dirname(fastxfer.__file__)}; kernels {_core.simd_level()}")
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        r = subprocess.run([sys.executable, "-m", "fastxfer.cli", "run", "-np", "2", "--", sys.executable, script],
                           capture_output=True, text=True, timeout=300, cwd=d)
    print(r.stdout + r.stderr, end="")
    ok = r.returncode == 0 and r.stdout.count("allreduce exact") == 2
    print("wheel check: " + ("passed" if ok else f"FAILED (exit code {r.returncode})"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
