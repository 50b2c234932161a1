"""Shared memory and the launcher next to other local users and in a cramped container: segment
names that are fresh and unguessable at every init, segments nobody else owns, a /dev/shm too
small for the segment, and workers that die with their launcher. Everything runs through the real
launcher and engine."""

import os
import pty
import pwd
import re
import shutil
import signal
import stat
import time

import pytest

from _launch import fastxfer_segments, finish, launch, launch_cmd, launch_env, run_command, start

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting a segment as another user needs root")


def _alive(pid):
    """Whether `pid` still runs (a zombie waiting for a parent that does not reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_until(cond, timeout, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


# ---- Row 3: names are fresh at every init, and a segment someone else made is refused ----------

REINIT = r"""
import os, sys, time, fastxfer as fx
from fastxfer.comm import group
r = int(os.environ["FASTXFER_RANK"])
for i in range(2):
    if r == 1:
        time.sleep(2)  # so rank 0's segment sits in /dev/shm, where anyone can see its name
    fx.init()
    print(f"SEGMENT {i} rank {r} {group.layout().segment}", flush=True)
    fx.barrier()
    fx.shutdown()
if r == 0 and os.geteuid() == 0:
    # what another local user learns from this rank's environment, where the job's secret is
    pid = os.fork()
    if pid == 0:
        os.setgid(65534); os.setuid(65534)
        try:
            open(f"/proc/{os.getppid()}/environ", "rb").read()
            print("ENVIRON readable", flush=True)
        except PermissionError:
            print("ENVIRON hidden", flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"""


def _of_job(p):
    """The segments in /dev/shm of the job whose launcher is `p` (other jobs may run meanwhile)."""
    return {n for n in fastxfer_segments() if n.startswith(f"fastxfer-{p.pid}-")}


def test_segment_name_is_fresh_and_unguessable_at_every_init():
    p = start(launch_cmd(2, "-c", REINIT), env=launch_env())
    seen = set()
    while p.poll() is None:
        seen.update(_of_job(p))
        time.sleep(0.02)
    r = finish(p, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    names = {}
    for i, rank, path in re.findall(r"SEGMENT (\d) rank (\d) (\S+)", r.stdout):
        names.setdefault(int(i), set()).add(path)
    # every rank of an init agrees on one name; the second init does not reuse the first's
    assert sorted(names) == [0, 1] and all(len(v) == 1 for v in names.values()), r.stdout
    first, second = names[0].pop(), names[1].pop()
    assert first != second
    for path in (first, second):
        # the launcher's pid first (its sweep finds the job's segments by it), then 128 bits
        assert re.fullmatch(rf"/dev/shm/fastxfer-{p.pid}-[0-9a-f]{{32}}", path), path
    # what other users could see while the job ran: only the name in use at that moment, from
    # which the next one cannot be derived (the job id is no part of it; the secret is hidden)
    assert seen <= {os.path.basename(first), os.path.basename(second)} and seen, seen
    if os.geteuid() == 0:
        assert "ENVIRON hidden" in r.stdout, r.stdout
    assert not _of_job(p)


PLANT = r"""
import os, sys, time, fastxfer as fx
from fastxfer.comm import group
r = int(os.environ["FASTXFER_RANK"])
uid, mode, flag = int(os.environ["PLANT_UID"]), int(os.environ["PLANT_MODE"], 8), os.environ["PLANT_FLAG"]
fx.init()
size = [int(b, 16) - int(a, 16) for a, b in (l.split()[0].split("-") for l in open("/proc/self/maps")
                                             if group.layout().segment in l)][0]
fx.barrier()
fx.shutdown()
# The worst case: someone learned the name the job's next init will use (as if it were guessable)
# and plants a segment of the right size there before any rank gets to it.
target = group.detect_layout(1).segment
if r == 0:
    pid = os.fork()
    if pid == 0:
        os.setgid(uid); os.setuid(uid); os.umask(0)
        fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
        os.ftruncate(fd, size)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    print(f"PLANTED {target}", flush=True)
    open(flag, "w").close()
else:
    while not os.path.exists(flag):
        time.sleep(0.02)
try:
    fx.init()
    print(f"ATTACHED rank {r}", flush=True)
except fx.FastxferError as e:
    print(f"REFUSED rank {r}: {type(e).__name__}: {e}", flush=True)
    sys.exit(9)
"""


@as_root
@pytest.mark.parametrize("who,mode", [("nobody", "0666"), ("this user", "0644")])
def test_a_planted_segment_is_refused_by_every_rank(tmp_path, who, mode):
    uid = NOBODY if who == "nobody" else os.geteuid()
    env = {"PLANT_UID": str(uid), "PLANT_MODE": mode, "PLANT_FLAG": str(tmp_path / "planted"),
           "FASTXFER_ATTACH_TIMEOUT": "60"}
    r = None
    try:
        r = launch(2, "-c", PLANT, env=env, launcher_args=["--grace", "5"], timeout=120)
        assert "ATTACHED" not in r.stdout, r.stdout + r.stderr
        planted = re.search(r"PLANTED (\S+)", r.stdout).group(1)
        refused = dict(re.findall(r"REFUSED rank (\d): (.*)", r.stdout))
        assert sorted(refused) == ["0", "1"], r.stdout + r.stderr
        owner = f"owned by uid {uid} ({pwd.getpwuid(uid).pw_name})"
        # the creator finds the name taken; the other rank opens the file and refuses it: both
        # name the path and the owner and mode they found
        assert refused["0"].startswith(f"FastxferError: refusing to create shared-memory segment {planted}: "
                                       f"a file {owner} with mode {mode} is already there"), refused["0"]
        assert refused["1"].startswith(f"FastxferError: refusing to use shared-memory segment {planted}: it is "
                                       f"a file {owner} with mode {mode}, but this job's segments are files owned "
                                       f"by uid {os.geteuid()}"), refused["1"]
        assert r.returncode == 9
        assert "failed first (exit code 9)" in r.stderr.strip().splitlines()[-1]
        if who == "nobody":  # not this user's to remove: the launcher leaves it alone
            assert os.stat(planted).st_uid == NOBODY
    finally:
        for leftover in re.findall(r"PLANTED (\S+)", r.stdout if r else ""):
            if os.path.lexists(leftover):
                os.unlink(leftover)


# ---- Row 4: a /dev/shm smaller than the segment ----------------------------------------------

FILL_AND_REDUCE = r"""
import os, numpy as np, fastxfer as fx
from fastxfer.comm import group
fx.init()
seg = group.layout().segment
size = [int(b, 16) - int(a, 16) for a, b in (l.split()[0].split("-") for l in open("/proc/self/maps")
                                             if seg in l)][0]
print(f"SEGMENT rank {fx.rank()} {seg} {size}", flush=True)
fill = os.environ["FILL_DIR"]  # the test's small private tmpfs, never a disk
st = os.statvfs(fill)
assert st.f_blocks * st.f_frsize <= 256 << 20, f"{fill} is not the test's small tmpfs"
if fx.rank() == 0:
    # take every byte still free next to the segment: pages not reserved up front would now be
    # a SIGBUS in the allreduce below
    with open(os.path.join(fill, "filler"), "wb") as f:
        try:
            for _ in range(256):
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
fx.barrier()
x = np.full(8_000_000, fx.rank() + 1, np.float32)  # 32 MB per rank: every page of every window
y = fx.allreduce(x, op="sum")
assert (y == sum(range(1, fx.size() + 1))).all()
print(f"OK reduce rank {fx.rank()}", flush=True)
fx.shutdown()
"""


def _private_shm(mounts, tmp_path):
    """A command prefix that runs what follows in a private mount namespace with tmpfs file systems
    mounted as `mounts` ({mount point: size in MiB}); skips the test where that is not permitted."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to give the job a small /dev/shm of its own")
    setup = " && ".join(f"mount -t tmpfs -o size={mb}m,mode=1777 tmpfs {where}" for where, mb in mounts.items())
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", setup + ' && exec "$@"', "sh"]
    probe = run_command(prefix + ["true"], timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here (unshare --mount needs CAP_SYS_ADMIN): "
                    f"{probe.stderr.strip()[-300:]}")
    return prefix


def test_a_small_dev_shm_is_a_clear_error_and_a_smaller_window_fits(tmp_path):
    prefix = _private_shm({"/dev/shm": 64}, tmp_path)  # Docker's default --shm-size
    cmd = prefix + launch_cmd(4, "-c", FILL_AND_REDUCE, launcher_args=["--grace", "1"])
    env = {"FILL_DIR": "/dev/shm"}
    r = run_command(cmd, env=launch_env({**env, "FASTXFER_SHM_WINDOW_MB": "16"}), timeout=120)  # the default
    assert r.returncode == 1, r.stdout + r.stderr  # rank 0's FastxferError, not 135 (SIGBUS)
    assert "SIGBUS" not in r.stderr and "OK reduce" not in r.stdout
    m = re.search(r"FastxferError: cannot reserve the shared-memory segment for 4 ranks: it needs ([\d.]+) MiB "
                  r"\((\d+) bytes\) in /dev/shm, and only ([\d.]+) MiB is free there \(No space left on device\)\. "
                  r"(.*)", r.stderr)
    assert m, r.stderr
    need, free, advice = int(m.group(2)), float(m.group(3)), m.group(4)
    assert need > 64 << 20 and free == 64
    for what in ("docker run --shm-size=", "FASTXFER_SHM_DIR", "FASTXFER_SHM_WINDOW_MB (now 16"):
        assert what in advice, advice
    assert "rank 0 failed first (exit code 1)" in r.stderr.strip().splitlines()[-1]
    # the window the message suggests: 4 ranks then fit in 64 MiB, even with the rest of it
    # taken by someone else while they reduce
    window = re.search(r"FASTXFER_SHM_WINDOW_MB=([\d.]+) or less fits", advice).group(1)
    r = run_command(cmd, env=launch_env({**env, "FASTXFER_SHM_WINDOW_MB": window}), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    sizes = {int(s) for s in re.findall(r"SEGMENT rank \d /dev/shm/\S+ (\d+)", r.stdout)}
    assert len(sizes) == 1 and sizes.pop() <= 64 << 20
    assert sorted(re.findall(r"OK reduce rank (\d)", r.stdout)) == ["0", "1", "2", "3"], r.stdout


def test_shm_dir_moves_the_segment_to_a_larger_tmpfs(tmp_path):
    big = tmp_path / "shm"
    big.mkdir()
    prefix = _private_shm({"/dev/shm": 64, str(big): 128}, tmp_path)
    cmd = prefix + launch_cmd(4, "-c", FILL_AND_REDUCE, launcher_args=["--grace", "1"])
    r = run_command(cmd, env=launch_env({"FASTXFER_SHM_WINDOW_MB": "16", "FASTXFER_SHM_DIR": str(big),
                                         "FILL_DIR": str(big)}), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    segs = set(re.findall(r"SEGMENT rank \d (\S+) (\d+)", r.stdout))
    assert len(segs) == 1, r.stdout
    path, size = segs.pop()
    assert os.path.dirname(path) == str(big) and int(size) > 64 << 20
    assert sorted(re.findall(r"OK reduce rank (\d)", r.stdout)) == ["0", "1", "2", "3"], r.stdout


FILL_AND_ADD_SET = r"""
import os, time, numpy as np, fastxfer as fx
fx.init()
r = fx.rank()
fill = os.environ["FILL_DIR"]
assert os.statvfs(fill).f_blocks * os.statvfs(fill).f_frsize <= 64 << 20, f"{fill} is not the test's small tmpfs"

def fill_up():
    if r == 0:
        with open(os.path.join(fill, "filler"), "wb") as f:
            try:
                for _ in range(64):
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
    fx.barrier()

fill_up()
t0 = time.monotonic()
try:
    fx.add_process_set([1, 2])
except fx.FastxferError as e:
    print(f"FAILED rank {r} after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
else:
    raise SystemExit("add_process_set worked in a full /dev/shm")
assert np.array_equal(fx.allreduce(np.ones(2), op="sum"), [3.0, 3.0])  # the job goes on
if r == 0:
    os.unlink(os.path.join(fill, "filler"))
fx.barrier()
pair = fx.add_process_set([1, 2])  # the failed call registered nothing: id 1
assert pair.process_set_id == 1, pair
if r in pair.ranks:
    assert np.array_equal(fx.allreduce(np.full(2, r), op="sum", process_set=pair), [3, 3])
fx.remove_process_set(pair)
print(f"OK again rank {r}", flush=True)
fill_up()
fx.add_process_set([1, 2])  # uncaught now: the launcher's last line
"""


def test_a_full_dev_shm_fails_add_process_set_on_every_rank_at_once(tmp_path):
    """Issue 34 row 4: the set's first rank cannot create the set's segment (a 16 MiB /dev/shm, full):
    every rank raises its reason within seconds (not after the 120 s attach timeout), nothing is
    registered, the job goes on, and the launcher's last line blames rank 1."""
    prefix = _private_shm({"/dev/shm": 16}, tmp_path)
    cmd = prefix + launch_cmd(3, "-c", FILL_AND_ADD_SET, launcher_args=["--grace", "5"])
    r = run_command(cmd, env=launch_env({"FILL_DIR": "/dev/shm", "FASTXFER_SHM_WINDOW_MB": "1"}), timeout=300)
    out = r.stdout + r.stderr
    failed = dict((m[0], (float(m[1]), m[2])) for m in re.findall(r"FAILED rank (\d) after ([\d.]+)s: (.*)", r.stdout))
    assert sorted(failed) == ["0", "1", "2"], out
    reason = r"cannot reserve the shared-memory segment for 2 ranks: it needs [\d.]+ MiB .*\(No space left on device\)"
    for rank, (took, msg) in failed.items():
        assert took < 30, out
        assert re.match(r"FastxferError: add_process_set\(\[1, 2\]\): rank 1 could not create the set's shared "
                        r"memory" + (" \\(this rank\\)" if rank == "1" else "") + r", so no rank registered it: " + reason,
                        msg), msg
    assert sorted(re.findall(r"OK again rank (\d)", r.stdout)) == ["0", "1", "2"], out
    assert r.returncode == 1, out
    last = r.stderr.strip().splitlines()[-1]
    assert re.search(r"job failed: rank 1 (failed first|failed \(named by rank [02]: add_process_set)", last), last


# ---- Row 6: workers die with their launcher --------------------------------------------------

WAIT_FOREVER = r"""
import os, time, fastxfer as fx
r = int(os.environ["FASTXFER_RANK"])
open(os.path.join(os.environ["PID_DIR"], str(r)), "w").write(str(os.getpid()))
if r == 0 or os.environ.get("ALL_INIT"):
    fx.init()  # without ALL_INIT rank 0 waits for rank 1 here, its segment in /dev/shm
time.sleep(300)
"""


def _start_and_get_pids(tmp_path, env):
    p = start(launch_cmd(2, "-c", WAIT_FOREVER), env=launch_env({"PID_DIR": str(tmp_path), **env}))
    files = [tmp_path / "0", tmp_path / "1"]

    def ready():
        return all(f.exists() and f.read_text() for f in files)

    if not _wait_until(lambda: ready() or p.poll() is not None, 60) or not ready():
        r = finish(p, timeout=60)
        pytest.fail(f"the workers did not start: {r.stdout} {r.stderr}")
    return p, [int(f.read_text()) for f in files]


def _kill_leftovers(pids):
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_workers_die_with_a_killed_launcher(tmp_path):
    p, pids = _start_and_get_pids(tmp_path, {"ALL_INIT": "1"})
    try:
        time.sleep(1)  # both inside the job's sleep
        assert all(_alive(pid) for pid in pids)
        os.kill(p.pid, signal.SIGKILL)  # nothing the launcher can do about this one
        t0 = time.monotonic()
        gone = _wait_until(lambda: not any(_alive(pid) for pid in pids), 10)
        took = time.monotonic() - t0
        assert gone, f"workers {[pid for pid in pids if _alive(pid)]} outlived their launcher by 10 s"
        assert took < 5
    finally:
        _kill_leftovers(pids)
        finish(p, timeout=60)


@pytest.mark.parametrize("sig,why", [(signal.SIGHUP, "lost its terminal (SIGHUP)"),
                                     (signal.SIGTERM, "asked to stop (SIGTERM)")])
def test_launcher_stop_signal_stops_the_job_cleanly(tmp_path, sig, why):
    p, pids = _start_and_get_pids(tmp_path, {})
    try:
        # rank 0 has created the segment and waits for rank 1, which never comes: its name is
        # in /dev/shm, and only the launcher can remove it once the ranks are stopped
        assert _wait_until(lambda: _of_job(p), 60)
        t0 = time.monotonic()
        os.kill(p.pid, sig)
        r = finish(p, timeout=60)
        took = time.monotonic() - t0
    finally:
        _kill_leftovers(pids)
    assert r.returncode == 128 + sig, r.stdout + r.stderr
    assert took < 15
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"fastxfer run: job stopped: the launcher {why}; all ranks stopped "
                    "(rank 0: killed by SIGTERM, rank 1: killed by SIGTERM)"), r.stderr
    assert not any(_alive(pid) for pid in pids)
    assert not _of_job(p)


def test_launcher_that_loses_its_terminal_stops_the_job(tmp_path):
    """The real thing: the launcher runs on a terminal, and the terminal goes away (the kernel
    sends SIGHUP; every write to the terminal fails from then on)."""
    env = launch_env({"PID_DIR": str(tmp_path)})
    launcher, master = pty.fork()
    if launcher == 0:  # the launcher: a session leader on the terminal
        try:
            cmd = launch_cmd(2, "-c", WAIT_FOREVER)
            os.execve(cmd[0], cmd, env)
        finally:
            os._exit(127)
    os.set_blocking(master, False)
    files = [tmp_path / "0", tmp_path / "1"]
    pids = []
    try:
        def ready():
            try:
                while os.read(master, 65536):  # keep the terminal drained
                    pass
            except (BlockingIOError, OSError):
                pass
            return all(f.exists() and f.read_text() for f in files) and any(
                n.startswith(f"fastxfer-{launcher}-") for n in fastxfer_segments())

        assert _wait_until(ready, 60), "the job did not start"
        pids = [int(f.read_text()) for f in files]
        os.close(master)  # hang up
        master = None
        status = None
        deadline = time.monotonic() + 30
        while status is None and time.monotonic() < deadline:
            done, st = os.waitpid(launcher, os.WNOHANG)
            status = st if done else None
            time.sleep(0.05)
        assert status is not None, "the launcher did not stop within 30 s of losing its terminal"
        assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGHUP
        assert not any(_alive(pid) for pid in pids)
        assert not any(n.startswith(f"fastxfer-{launcher}-") for n in fastxfer_segments())
    finally:
        if master is not None:
            os.close(master)
        _kill_leftovers(pids)
        if _alive(launcher):
            os.kill(launcher, signal.SIGKILL)
        try:
            os.waitpid(launcher, 0)
        except ChildProcessError:
            pass


def test_segment_files_are_owner_only(tmp_path):
    """The segment as other users find it while it has a name: mode 0600, this user's."""
    p, pids = _start_and_get_pids(tmp_path, {})
    try:
        def sized():  # the name appears empty; it has its full size once every page is reserved
            names = sorted(_of_job(p))
            return names and os.stat(f"/dev/shm/{names[0]}").st_size > 0 and names[0]

        assert _wait_until(sized, 60)
        st = os.stat(f"/dev/shm/{sized()}")
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        # already reserved: the full size, every page allocated (st_blocks counts 512-byte units)
        assert st.st_size > 0 and st.st_blocks * 512 >= st.st_size
    finally:
        os.kill(p.pid, signal.SIGTERM)
        finish(p, timeout=60)
        _kill_leftovers(pids)
