"""The launcher table's parsing (comm/launchers.py) and the rendezvous without MPI on one host
(comm/host_rendezvous.py), with another local user at the other end. The launchers themselves run
for real in tests/multiproc/test_launchers.py."""

import os
import socket
import threading
import time

import pytest

from fastxfer.comm import host_rendezvous, launchers
from fastxfer.errors import FastxferError

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")


@pytest.mark.parametrize("tasks,node,want", [("2", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("4,1(x2)", 2, 1)])
def test_slurm_task_lists(tasks, node, want):
    assert launchers.slurm_tasks_on_node(tasks, node) == want


@pytest.mark.parametrize("tasks,node,msg", [("2(x3)", 3, "SLURM_NODEID=3 is outside"), ("two", 0, "not a task list")])
def test_slurm_task_lists_that_do_not_parse_are_named(tasks, node, msg):
    with pytest.raises(FastxferError, match=msg):
        launchers.slurm_tasks_on_node(tasks, node)


SRUN = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize("env,launcher,rank,size", [
    (SRUN, "Slurm srun", 1, 2),
    ({**SRUN, "PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "5"}, "Slurm srun --mpi=pmi2", 1, 2),  # srun's own PMI-2
    ({**SRUN, "PMIX_RANK": "1"}, "Slurm srun --mpi=pmix", 1, 2),
    # mpirun inside an allocation: its daemons are srun tasks (one per node); the ranks are mpirun's
    ({**SRUN, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "OMPI_COMM_WORLD_RANK": "3",
      "OMPI_COMM_WORLD_SIZE": "4"}, "Open MPI mpirun", 3, 4),
    ({**SRUN, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
      "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "h"}, "torchrun", 1, 2),  # srun torchrun
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
      "HOROVOD_CROSS_SIZE": "1"}, "horovodrun", 1, 2),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, None, 0, 1),  # an sbatch script: no step
])
def test_the_innermost_launcher_describes_the_process(monkeypatch, env, launcher, rank, size):
    for k in list(os.environ):
        if k.startswith(("SLURM_", "OMPI_", "PMI", "HOROVOD_", "TORCHELASTIC_")) or k in ("RANK", "WORLD_SIZE",
                                                                                          "TF_CONFIG"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    a = launchers.detect()
    if launcher is None:
        assert a is None
        return
    assert (a.launcher, a.rank, a.size) == (launcher, rank, size)


def test_a_tf_config_parameter_server_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1"], "ps": ["b:1"]}, "task": {"type": "ps", '
                                    '"index": 0}}')
    with pytest.raises(FastxferError, match="makes this process a 'ps' task"):
        launchers.tf_config()


def _serve(key, size, out):
    try:
        out["rank0"] = host_rendezvous.meet(launcher="test", key=key, generation=0, rank=0, size=size, host="h",
                                            timeout=20)
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["rank0"] = e


def _as_nobody(fn):
    """Runs fn() in a forked child with uid/gid nobody; returns what it wrote to the pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(w, fn().encode())
        except BaseException as e:  # noqa: BLE001 - the test sees it
            os.write(w, f"child failed: {e!r}".encode())
        finally:
            os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 4096):
        got += chunk
    os.waitpid(pid, 0)
    return got.decode()


@as_root
def test_another_user_connecting_to_the_rendezvous_learns_nothing():
    key = f"test-{os.getpid()}-spy"
    out = {}
    t = threading.Thread(target=_serve, args=(key, 2, out))
    t.start()

    addr = host_rendezvous.address(key, 0)  # the name rank 0 listens at (the uid in it is no secret)

    def spy():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        for _ in range(1000):
            try:
                s.connect(addr)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.01)
        else:
            return "never connected"
        try:  # rank 0 may close before, during or after this: refused each way
            s.sendall(b'{"rank": 1, "size": 2, "launcher": "test", "host": "h", "pid": 1}\n')
            s.settimeout(10)
            return "heard: " + s.recv(4096).decode()
        except OSError:
            return "heard: "

    heard = _as_nobody(spy)
    assert heard == "heard: ", heard  # it connected, and rank 0 closed without a word
    joined = host_rendezvous.meet(launcher="test", key=key, generation=0, rank=1, size=2, host="h", timeout=20)
    t.join()
    assert out["rank0"] == joined and len(joined["token"]) == 32


@as_root
def test_a_rendezvous_held_by_another_user_is_refused_by_name():
    key = f"test-{os.getpid()}-squat"
    addr = host_rendezvous.address(key, 0)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # nobody takes the name first and listens
        try:
            os.close(r)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(addr)
            s.listen(4)
            os.write(w, b"ready")
            c, _ = s.accept()
            c.recv(4096)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 5) == b"ready"
    try:
        with pytest.raises(FastxferError, match=f"belongs to user {NOBODY}, not to you: another user took the name"):
            host_rendezvous.meet(launcher="test", key=key, generation=0, rank=1, size=2, host="h", timeout=10)
        with pytest.raises(FastxferError, match="rank 0 cannot open this job's rendezvous .* another process holds it"):
            host_rendezvous.meet(launcher="test", key=key, generation=0, rank=0, size=2, host="h", timeout=10)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_ranks_that_disagree_on_the_size_fail_naming_it():
    key = f"test-{os.getpid()}-size"
    out = {}
    t = threading.Thread(target=_serve, args=(key, 2, out))
    t.start()
    with pytest.raises(FastxferError, match="rank 1 says the job has 3 ranks, rank 0 says 2"):
        host_rendezvous.meet(launcher="test", key=key, generation=0, rank=1, size=3, host="h", timeout=20)
    t.join()
    assert isinstance(out["rank0"], FastxferError) and "rank 1 says the job has 3 ranks" in str(out["rank0"])
