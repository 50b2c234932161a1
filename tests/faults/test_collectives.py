"""The engine under faults, through `fastxfer run`: ranks that disagree, peers that die or fall
silent, a shutdown while a peer still reduces, and shared-memory segment ownership."""

import os
import re
import stat
import time

import pytest

from _launch import fastxfer_segments, finish, launch, launch_cmd, launch_env, private_shm, start

W = "collectives_worker.py"


@pytest.mark.parametrize("kind", ["name", "shape", "dtype", "op", "order", "count", "compression", "oob",
                                  "alltoall_dtype", "alltoall_shape", "reducescatter_shape", "reducescatter_op",
                                  "kind"])
def test_mismatch_raises_on_every_rank(kind):
    r = launch(2, W, "mismatch", kind)
    out = r.stdout
    assert "NO ERROR" not in out
    # the same collective with different contents fails alone; different names (the ranks' sequences
    # differ: nothing lines up again) and the oob lane poison the group, every rank failing after
    after = "STILL-MISMATCH" if kind in ("name", "order", "count", "oob") else "RECOVERED"
    assert out.count("] MISMATCH rank") == 2 and out.count(f"] {after} rank") == 2, out + r.stderr
    # both ranks report the same disagreement
    msgs = sorted(set(re.sub(r"^\[\d\] MISMATCH rank \d: ", "", ln) for ln in out.splitlines()
                      if " MISMATCH rank" in ln))
    assert len(msgs) == 1, msgs
    assert r.returncode == 3


@pytest.mark.parametrize("how,n,compression", [("kill", 1000, "none"), ("kill", 3_000_000, "none"),
                                               ("exit", 3_000_000, "bf16"), ("kill", 300_001, "fp16"),
                                               ("kill", 3_000_000, "alltoall"), ("kill", 3_000_000, "reducescatter")])
def test_dead_peer_fails_the_others_fast(how, n, compression):
    with private_shm() as (env, folder):  # the job's segments in a folder of its own
        r = launch(3, W, "die", how, n, compression, env=env)
        left = fastxfer_segments(folder)
    survivors = re.findall(r"PEER-FAILURE rank (\d) after ([\d.]+)s: (.*)", r.stdout)
    assert sorted(s[0] for s in survivors) == ["0", "2"], r.stdout + r.stderr
    assert all(float(s[1]) < 10 for s in survivors)
    assert all("rank 1" in s[2] for s in survivors)
    # the launcher names the rank that failed first and exits with its code
    cause = "killed by SIGKILL" if how == "kill" else "exit code 17"
    assert f"rank 1 failed first ({cause})" in r.stderr
    assert r.returncode == (137 if how == "kill" else 17)
    assert left == []


def test_silent_peer_times_out():
    r = launch(2, W, "hang", env={"FASTXFER_TIMEOUT": "2"}, launcher_args=["--grace", "3"])
    m = re.search(r"TIMEOUT rank 0 after ([\d.]+)s: rank 1 stalled: rank 0 waited 2 s for rank 1 \(negotiation\) and "
                  r"rank 1 is alive but has not reached the next collective", r.stdout)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) < 10
    # the launcher names the silent rank, not the one that gave up waiting for it
    assert "job failed: rank 1 stalled (named by rank 0:" in r.stderr
    assert "rank 0 gave up waiting for it (exit code 6)" in r.stderr


def test_shutdown_while_a_peer_still_reduces_is_a_peer_failure_naming_it_not_a_hang():
    """Rank 0 shuts down while rank 1 still reduces: rank 0 has left the job (issue 34 row 7), so
    both see a PeerFailureError naming rank 0, and the launcher blames it."""
    r = launch(2, W, "shutdown_early")
    msg = "PeerFailureError: rank 0 finished (its script ended, or it called shutdown()) while rank 1 still submitted"
    assert f"SHUTDOWN-ERROR rank 0: {msg}" in r.stdout, r.stdout + r.stderr
    assert f"ERROR rank 1: {msg}" in r.stdout
    assert "fastxfer run: job failed: rank 0 finished while the others still ran collectives" in r.stderr
    assert r.returncode == 4


def test_segment_is_owner_only_and_gone_once_everyone_attached():
    with private_shm() as (env, folder):  # the job's segments in a folder of its own
        p = start(launch_cmd(2, W, "slow_attach"), env=launch_env(env))
        seen = mode = None
        deadline = time.monotonic() + 30
        while seen is None and time.monotonic() < deadline and p.poll() is None:
            new = fastxfer_segments(folder)
            if new:
                seen = new[0]
                mode = stat.S_IMODE(os.stat(os.path.join(folder, seen)).st_mode)
            time.sleep(0.02)
        r = finish(p, timeout=120)  # before any assert, so a failure never leaves the job running
        left = fastxfer_segments(folder)
    assert r.returncode == 0, r.stdout + r.stderr
    assert seen is not None, "the segment was never visible while rank 1 was late"
    # unguessable: the launcher's pid plus 128 random bits
    assert re.fullmatch(r"fastxfer-\d+-[0-9a-f]{32}", seen), seen
    assert mode == 0o600
    assert left == []
