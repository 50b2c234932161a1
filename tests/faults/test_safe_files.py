"""Issue 34 row 1: files fastxfer writes into a folder another local user can write too (a sticky,
world-writable folder such as /tmp). The other user (nobody, uid 65534) plants symbolic links at
the names a job will write -- the timeline, a data pack, the launcher's per-rank output -- pointing
at a file of root's; root's job must never write through them, and what it writes is its own
regular file (timelines mode 0600). Runs as root (CI is root): it changes to another user."""

import json
import os
import stat
import tempfile

import numpy as np
import pytest

from _launch import fastxfer_cmd, launch, run_command

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="planting links as another user needs root")


@pytest.fixture
def shared_dir():
    """A sticky world-writable folder (mode 1777, as /tmp) and a file of root's the links aim at."""
    d = tempfile.mkdtemp(prefix="fastxfer-shared-", dir="/tmp")
    os.chmod(d, 0o1777)
    victim = tempfile.NamedTemporaryFile(prefix="fastxfer-victim-", dir="/tmp", delete=False)
    victim.write(b"root's data\n")
    victim.close()
    os.chmod(victim.name, 0o644)
    yield d, victim.name
    for root, dirs, files in os.walk(d, topdown=False):
        for f in files:
            os.unlink(os.path.join(root, f))
        for x in dirs:
            os.rmdir(os.path.join(root, x)) if not os.path.islink(os.path.join(root, x)) else os.unlink(
                os.path.join(root, x))
    os.rmdir(d)
    os.unlink(victim.name)


def as_nobody(fn):
    """Runs fn() in a child process as uid/gid 65534."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            os._exit(0)
        except BaseException:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0, "the planting child failed"


def unchanged(victim):
    with open(victim, "rb") as f:
        assert f.read() == b"root's data\n", "a planted link was followed"


def own_regular(path, mode=None):
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid(), (path, st)
    if mode is not None:
        assert stat.S_IMODE(st.st_mode) == mode, oct(st.st_mode)


def test_a_timeline_replaces_a_planted_link_and_is_private(shared_dir):
    d, victim = shared_dir
    path = os.path.join(d, "timeline.json")
    as_nobody(lambda: os.symlink(victim, path))
    r = launch(2, "collectives_worker.py", "sweep", env={"FASTXFER_TIMELINE": path})
    assert r.returncode == 0, r.stderr[-3000:]
    unchanged(victim)
    own_regular(path, 0o600)
    with open(path) as f:
        events = json.load(f)
    assert {e.get("pid") for e in events if e.get("ph") == "X"} == {0, 1}


def test_a_process_set_timeline_refuses_a_planted_link(shared_dir):
    """A process set's engine writes its own file beside FASTXFER_TIMELINE (timeline.1.json): a link
    there is refused, not followed, and the error says why."""
    from fastxfer._safefile import open_append

    d, victim = shared_dir
    link = os.path.join(d, "log.txt")
    as_nobody(lambda: os.symlink(victim, link))
    with pytest.raises(PermissionError, match="is a symbolic link"):
        open_append(link)
    theirs = os.path.join(d, "theirs.txt")
    as_nobody(lambda: open(theirs, "w").close())
    with pytest.raises(PermissionError, match=r"belongs to nobody \(uid 65534\)"):
        open_append(theirs)
    unchanged(victim)
    # the engine's own open (csrc/engine/timeline.cc) refuses the same way
    import fastxfer as fx
    from fastxfer import _core

    fx.init()
    try:
        eng = fx.comm.group.engine()
        with pytest.raises(RuntimeError, match="symbolic link"):
            eng.start_timeline(link, False)
        with pytest.raises(RuntimeError, match="belongs to uid 65534"):
            eng.start_timeline(theirs, False)
    finally:
        fx.shutdown()
    del _core
    unchanged(victim)
    assert os.path.getsize(theirs) == 0


def test_a_data_pack_replaces_a_planted_link_and_keeps_the_umask(shared_dir, tmp_path):
    d, victim = shared_dir
    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    from PIL import Image

    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(src / "a.jpg")
    out = os.path.join(d, "train.fxpack")
    as_nobody(lambda: os.symlink(victim, out))
    r = run_command(fastxfer_cmd() + ["data", "pack", str(tmp_path / "src"), out, "--no-progress"], timeout=300)
    assert r.returncode == 0, r.stderr
    unchanged(victim)
    own_regular(out, 0o666 & ~_umask())
    assert not [f for f in os.listdir(d) if f.startswith(".")], "a temporary file was left behind"


def test_the_launchers_per_rank_output_refuses_a_planted_link(shared_dir):
    d, victim = shared_dir
    out = os.path.join(d, "out")
    as_nobody(lambda: (os.mkdir(out), os.chmod(out, 0o777), os.mkdir(os.path.join(out, "rank.0")),
                       os.chmod(os.path.join(out, "rank.0"), 0o777),
                       os.symlink(victim, os.path.join(out, "rank.0", "stdout"))))
    r = run_command(fastxfer_cmd() + ["run", "-np", "1", "--output-filename", out, "--", "python", "-c",
                                      "print('hello')"], timeout=120)
    unchanged(victim)
    assert r.returncode != 0 and "is a symbolic link" in r.stderr, r.stderr[-2000:]


def _umask():
    m = os.umask(0o022)
    os.umask(m)
    return m
