"""The one way tests start programs: `launch` runs N ranks through the real launcher (`fastxfer run`),
`run_command` any other command, both always under a timeout; `assert_ok` checks a job's result."""

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)  # the checkout
WORKERS = os.path.join(TESTS, "workers")
TIMEOUT = 300  # seconds; generous for 2 shared cores, but a hang still fails instead of blocking CI

# small window and bucket cap, so modest sizes already stream through several chunks/buckets
SMALL_BUFFERS = {
    "FASTXFER_SHM_WINDOW_MB": "0.25",
    "FASTXFER_BUCKET_CAP_MB": "0.5",
    "FASTXFER_STREAM_MIN_MB": "0.001",  # exercise the streaming-store paths too
}

# the modes keras_worker.py's `fit` runs in the shared Keras jobs (conftest.py: keras_job; TF_KERAS_SCRIPTS)
KERAS_FIT_MODES = "graph,eager,jit,accum,bf16comm,mixed_bfloat16,mixed_float16"
LEGACY_FIT_MODES = "graph,eager,bf16comm,accum,mixed_float16"

# hvd_parity_worker.py's front-end modes (tests/multiproc/test_horovod_parity.py), run in the shared
# 2-rank jobs of both Keras flavours; lrcallbacks writes its best-model files into the argument after them
HVD_PARTIAL = ["partial-fit", "partial-eager", "partial-register", "partialtape-eager", "partialtape-function"]
HVD_SPARSE = ["sparse-tape-eager", "sparse-tape-function", "sparse-fit"]
HVD_FRONT_END_MODES = ["lazybcast", "localbcast", *HVD_PARTIAL, "lrcallbacks", "queries", "signatures", *HVD_SPARSE]
# tape_options_worker.py's modes on both Keras flavours (tests/multiproc/test_tape_options.py)
TAPE_KERAS_MODES = "optimizer_groups,bpps,syncbn,local_vars"
HVD_SYNTHETIC_ARGS = ["--no-cuda", "--fp16-allreduce"]

# Scripts that share one job (tests/workers/run_scripts.py: TensorFlow starts once per rank for all of
# them; conftest.py's *_scripts_job fixtures), each table in the order the scripts run. Each script
# runs in a directory of its own, "{dir}" in its arguments; an argument ending in "/" is a directory
# made for it beforehand. A script that shuts fastxfer down leaves the next to join again; one after
# which the engine has failed (a mismatch in the whole job) ends the process itself and comes last.
# name: (script in the checkout, its arguments)

# 2 ranks, Keras 3 (keras3_scripts_job): the Horovod front ends (first: they check a warning given once
# per process), the Horovod-style example, Horovod's Keras synthetic benchmark, the Horovod collectives,
# gradients through the collectives, the native ops' programs (saved under {dir}/native-<mode>), buffer
# forwarding and held submits, the TensorFlow collectives and tape, the mismatch cases (each in a process
# set of its own: the job is unharmed), every dtype, and last Keras models that differ
KERAS3_SCRIPTS = {
    "hvd_front_ends": ("tests/workers/hvd_parity_worker.py", [",".join(HVD_FRONT_END_MODES), "{dir}/best/"]),
    "keras_horovod_style": ("examples/keras_horovod_style.py",
                            ["--epochs", "2", "--checkpoint-dir", "{dir}/checkpoints/"]),
    "tensorflow2_keras_synthetic_benchmark": (
        "tests/workers/horovod_examples/tensorflow2_keras_synthetic_benchmark.py", HVD_SYNTHETIC_ARGS),
    "hvd_collectives": ("tests/workers/hvd_collectives_worker.py", []),
    "gradients": ("tests/workers/gradients_worker.py", []),
    "tf_native": ("tests/workers/tf_native_worker.py", ["programs,engine_collectives,forwarding,hold", "{dir}/native"]),
    "tf_collectives_and_tape": ("tests/workers/tf_worker.py", ["collectives", "tape=none", "tape=bf16"]),
    "hvd_mismatch": ("tests/workers/hvd_mismatch_worker.py", []),
    "hvd_dtypes": ("tests/workers/hvd_dtypes_worker.py", []),
    "keras_mismatch": ("tests/workers/keras_worker.py", ["mismatch"]),
}

# 3 ranks, Keras 3 (keras3_three_ranks_job): process sets through TensorFlow and Keras (first: its init
# registers the sets), fit on 3 workers, the Horovod collectives front ends, gradients, mismatches, dtypes
KERAS3_SCRIPTS_3 = {
    "process_sets_tensorflow": ("tests/workers/process_sets_worker.py", ["tensorflow"]),
    "keras_fit_graph": ("tests/workers/keras_worker.py", ["fit", "graph"]),
    "hvd_collectives": ("tests/workers/hvd_collectives_worker.py", []),
    "gradients": ("tests/workers/gradients_worker.py", []),
    "hvd_mismatch": ("tests/workers/hvd_mismatch_worker.py", []),
    "hvd_dtypes": ("tests/workers/hvd_dtypes_worker.py", []),
}

# 2 ranks, tf-keras (TF_USE_LEGACY_KERAS=1; tf_keras_scripts_job): the front ends, Horovod's four
# TensorFlow 2 examples, the tape options, the native ops on a tf-keras model (saved under
# {dir}/native-legacy), and last fit in every legacy mode, SyncBatchNormalization and per-request
# bucket caps (the engine has failed after them)
TF_KERAS_SCRIPTS = {
    "hvd_front_ends": ("tests/workers/hvd_parity_worker.py", [",".join(HVD_FRONT_END_MODES), "{dir}/best/"]),
    "tensorflow2_keras_mnist": ("tests/workers/horovod_examples/tensorflow2_keras_mnist.py", []),
    "tensorflow2_mnist": ("tests/workers/horovod_examples/tensorflow2_mnist.py", []),
    "tensorflow2_keras_synthetic_benchmark": (
        "tests/workers/horovod_examples/tensorflow2_keras_synthetic_benchmark.py", HVD_SYNTHETIC_ARGS),
    "tensorflow2_synthetic_benchmark": (
        "tests/workers/horovod_examples/tensorflow2_synthetic_benchmark.py", HVD_SYNTHETIC_ARGS),
    "tape_options": ("tests/workers/tape_options_worker.py", [TAPE_KERAS_MODES]),
    "tf_native_legacy": ("tests/workers/tf_native_worker.py", ["legacy", "{dir}/native"]),
    "legacy_keras": ("tests/workers/keras_worker.py", ["seq", f"fit={LEGACY_FIT_MODES}", "syncbn", "bucketcap"]),
}

# 2 ranks, Keras 3 through the tf.numpy_function bridge (FASTXFER_TF_NATIVE=0, chosen per process;
# bridge_scripts_job): the bridge's programs and engine collectives (saved under {dir}/bridge-<mode>),
# the mismatch cases and every dtype
BRIDGE_MODES = "programs,engine_collectives"
BRIDGE_SCRIPTS = {
    "tf_bridge": ("tests/workers/tf_native_worker.py", [BRIDGE_MODES, "{dir}/bridge"]),
    "hvd_mismatch": ("tests/workers/hvd_mismatch_worker.py", []),
    "hvd_dtypes": ("tests/workers/hvd_dtypes_worker.py", []),
}


def fastxfer_cmd():
    exe = shutil.which("fastxfer")
    return [exe] if exe else [sys.executable, "-m", "fastxfer.cli"]


def start(cmd, *, env=None, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """Starts `cmd` in a session of its own (so a timeout can stop everything it started); see `finish`."""
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True)


def finish(p, *, timeout=TIMEOUT):
    """Waits for a `start`ed command and returns its CompletedProcess; fails the test on timeout.

    On timeout SIGTERM comes first, so a `fastxfer run` launcher can stop its ranks (they have sessions
    of their own), then SIGKILL."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(p)
        out, err = p.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(map(str, p.args))}\n{_tail(out, err)}", pytrace=False)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run_command(cmd, *, timeout=TIMEOUT, env=None, cwd="/", **kw):
    """Runs `cmd` to the end and returns its CompletedProcess (text output); fails the test on timeout."""
    return finish(start(cmd, env=env, cwd=cwd, **kw), timeout=timeout)


def _stop(p):
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def launch_cmd(np_, worker, *args, launcher_args=()):
    """`fastxfer run -np N [launcher_args] -- python <worker> args...` as a list.

    `worker` is a file in tests/workers/, an absolute path, or "-c" with the code as first arg."""
    program = worker if worker == "-c" or os.path.isabs(worker) else os.path.join(WORKERS, worker)
    return fastxfer_cmd() + ["run", "-np", str(np_), *map(str, launcher_args), "--", sys.executable, program,
                             *map(str, args)]


def launch_env(env=None):
    """This environment, SMALL_BUFFERS unless already set, then `env` on top."""
    full = dict(os.environ)
    for k, v in SMALL_BUFFERS.items():
        full.setdefault(k, v)
    full.update(env or {})
    return full


def launch(np_, worker, *args, env=None, timeout=TIMEOUT, launcher_args=(), cwd="/"):
    """Runs `launch_cmd(...)` to the end under a timeout; returns the CompletedProcess."""
    return run_command(launch_cmd(np_, worker, *args, launcher_args=launcher_args), timeout=timeout,
                       env=launch_env(env), cwd=cwd)


MPIRUN = shutil.which("mpirun")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}  # containers often run as root
needs_mpi = pytest.mark.skipif(MPIRUN is None or importlib.util.find_spec("mpi4py") is None,
                               reason="needs mpirun and mpi4py (pip install 'fastxfer[mpi]')")


def mpi_launch(np_, worker, *args, per_host=None, env=None, timeout=TIMEOUT):
    """`mpirun -np N python <worker> args...`, the other way to start ranks; with per_host=k, ranks get
    host ids by rank // k (hosts emulated on this machine through FASTXFER_HOST_ID)."""
    program = worker if os.path.isabs(worker) else os.path.join(WORKERS, worker)
    cmd = [MPIRUN, "-np", str(np_), "--oversubscribe", "--bind-to", "none"]
    if per_host:
        inner = f"FASTXFER_HOST_ID=h$((OMPI_COMM_WORLD_RANK / {per_host})) exec {sys.executable} {program} "
        cmd += ["sh", "-c", inner + " ".join(map(str, args))]
    else:
        cmd += [sys.executable, program, *map(str, args)]
    return run_command(cmd, timeout=timeout, env=launch_env({**MPI_ENV, **(env or {})}))


_PREFIX = re.compile(r"^\[\s*(\d+)\] ")  # the launcher's rank prefix; absent under plain mpirun
_RANK = re.compile(r"\brank[ =](\d+)\b")


def ok_lines(output, tag):
    """(rank, line) for every line `OK <tag>...`; the rank from the launcher's prefix, else from 'rank N'."""
    found = []
    for line in output.splitlines():
        m = _PREFIX.match(line)
        body = line[m.end():] if m else line
        if re.match(rf"OK {re.escape(tag)}(\s|:|$)", body):
            r = m or _RANK.search(body)
            found.append((int(r.group(1)) if r else None, line))
    return found


def launch_scripts(np_, scripts, *, env=None, timeout=TIMEOUT):
    """One job of tests/workers/run_scripts.py: `scripts`, a list of (name, cwd, script, args), run one
    after the other in each rank's one process (TensorFlow starts once); see `script_output`."""
    argv = []
    for name, cwd, script, args in scripts:
        program = script if os.path.isabs(script) else os.path.join(WORKERS, script)
        argv += ["::", name, str(cwd), program, *map(str, args)]
    return launch(np_, "run_scripts.py", *argv[1:], env=env, timeout=timeout)


def script_output(r, name, np_=2, *, ends_the_job=False):
    """The stdout lines of script `name` in a job of tests/workers/run_scripts.py (each rank's lines
    between its `BEGIN <name>` and `END <name>`, prefixes kept), as a CompletedProcess with the job's
    exit code; fails (with the job's output tail) unless the job exited 0 and every rank ran it to the end.
    ends_the_job: the script is the job's last and ends the process itself (no `END` line); every rank
    must have begun it, and its lines run to the end of the output."""
    begun, ended, section = {}, set(), []
    for line in r.stdout.splitlines():
        m = _PREFIX.match(line)
        if not m:
            continue
        rank, body = int(m.group(1)), line[m.end():]
        if body == f"BEGIN {name}":
            begun[rank] = True
        elif body == f"END {name}" and begun.get(rank):
            begun[rank] = False
            ended.add(rank)
        elif begun.get(rank):
            section.append(line)
    if ends_the_job:
        ended = {rank for rank, on in begun.items() if on}
    assert r.returncode == 0 and sorted(ended) == list(range(np_)), \
        f"{name}: exit code {r.returncode}, ran to the end on ranks {sorted(ended)} of 0..{np_ - 1}\n" \
        f"{_tail(r.stdout, r.stderr)}"
    return subprocess.CompletedProcess(r.args, r.returncode, "\n".join(section) + "\n", r.stderr)


def _tail(out, err, n=4000):
    return f"--- stdout (tail) ---\n{(out or '')[-n:]}\n--- stderr (tail) ---\n{(err or '')[-n:]}"


def assert_ok(r, np_, tag):
    """The job exited 0 and each of ranks 0..np_-1 printed exactly one `OK <tag>` line; returns those lines
    in rank order."""
    assert r.returncode == 0, f"exit code {r.returncode}\n{_tail(r.stdout, r.stderr)}"
    found = sorted(ok_lines(r.stdout, tag), key=lambda x: (x[0] is None, x[0] or 0))
    ranks = [k for k, _ in found]
    assert ranks == list(range(np_)), f"'OK {tag}' lines from ranks {ranks}, want one from each of " \
                                      f"0..{np_ - 1}\n{_tail(r.stdout, r.stderr)}"
    return [line for _, line in found]


def fastxfer_segments(folder="/dev/shm"):
    try:
        return sorted(n for n in os.listdir(folder) if n.startswith("fastxfer-"))
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def private_shm():
    """A segment folder of the caller's own in /dev/shm, for jobs started with its FASTXFER_SHM_DIR:
    what such a job leaves there is its own, whatever else runs on the machine meanwhile (the suite runs
    in two test processes). Yields (env, folder); removes the folder afterwards."""
    folder = tempfile.mkdtemp(prefix="fxtest-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        yield {"FASTXFER_SHM_DIR": folder}, folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
