"""The ranks of one host meet without MPI: for launchers that start every rank of a job on this host
but wire no MPI (plain ``srun``, ``torchrun``, TF_CONFIG jobs, horovodrun's gloo mode).

The host's first rank listens on an abstract Unix socket whose name comes from the launcher's
identity for the job step (its job and step ids, its run id and port...), the user id and the
number of inits so far; the others connect, say who they are, and get back 128 fresh random bits
that name the job's shared-memory segment (comm/segments.py), plus every rank's place.

Nothing here trusts the name to be secret: both ends check the other's credentials
(SO_PEERCRED) and talk only to a process of the same user, so another local user can neither
learn the segment's name nor pose as the first rank. What another user can do is take the name
first: then init() fails with an error saying so, never joins the wrong job.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import struct
import time

from fastxfer.comm import rendezvous
from fastxfer.errors import FastxferError

_UCRED = struct.Struct("3i")  # pid, uid, gid


def address(key: str, generation: int) -> bytes:
    digest = hashlib.sha256(f"{os.getuid()}/{key}/{generation}".encode()).hexdigest()[:40]
    return b"\0fastxfer-host-" + digest.encode()


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


def _send(sock: socket.socket, msg: dict) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


def _recv(sock: socket.socket, deadline: float) -> dict:
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
        if len(buf) > 1 << 16:
            raise ConnectionError("message too long")
    msg = rendezvous.parse_message(buf)  # bounded: never a RecursionError or a non-object
    if msg is None:
        raise ValueError("not a rendezvous message")
    return msg


def meet(*, launcher: str, key: str, generation: int, rank: int, size: int, host: str, timeout: float) -> dict:
    """Forms the job of `size` ranks that all run on this host; returns {"token": 32 hex digits,
    "creator": the first rank's pid}. Rank 0 listens, the others connect. FastxferError naming the
    ranks that did not come, or what disagreed, within `timeout` seconds."""
    addr = address(key, generation)
    deadline = time.monotonic() + timeout
    me = dict(rank=rank, size=size, launcher=launcher, host=host, pid=os.getpid())
    if rank == 0:
        return _serve(addr, me, deadline, timeout)
    return _join(addr, me, deadline, timeout)


def _serve(addr: bytes, me: dict, deadline: float, timeout: float) -> dict:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            srv.bind(addr)
        except OSError:
            raise FastxferError(
                f"{me['launcher']}: rank 0 cannot open this job's rendezvous on the host (abstract socket "
                f"@{addr[1:].decode()}): another process holds it. Is a second copy of this job step running, or "
                "has another user taken the name? Start the job again (a new step gets a new name)") from None
        srv.listen(me["size"])
        conns: dict[int, socket.socket] = {}
        try:
            while len(conns) < me["size"] - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(1, me["size"]) if r not in conns]
                    raise FastxferError(
                        f"{me['launcher']} announced {me['size']} ranks on this host, but rank(s) "
                        f"{', '.join(map(str, missing))} did not reach rank 0 within {timeout:g} s "
                        "(FASTXFER_ATTACH_TIMEOUT). Did they start, and on this host?")
                srv.settimeout(left)
                try:
                    c, _ = srv.accept()
                except TimeoutError:
                    continue
                try:
                    _, uid = peer(c)
                    if uid != os.getuid():  # another user: say nothing
                        c.close()
                        continue
                    them = _recv(c, min(deadline, time.monotonic() + 10))
                except (OSError, ValueError):
                    c.close()
                    continue
                problem = _disagreement(me, them, conns)
                if problem:
                    _send(c, {"error": problem})
                    c.close()
                    raise FastxferError(f"{me['launcher']}: {problem}")
                conns[int(them["rank"])] = c
            reply = {"token": secrets.token_hex(16), "creator": me["pid"]}
            for c in conns.values():
                _send(c, reply)
            return reply
        finally:
            for c in conns.values():
                c.close()
    finally:
        srv.close()


def _disagreement(me: dict, them: dict, conns: dict) -> str:
    r = them.get("rank")
    if them.get("size") != me["size"]:
        return f"rank {r} says the job has {them.get('size')} ranks, rank 0 says {me['size']}"
    if not isinstance(r, int) or not 0 < r < me["size"]:
        return f"a process says it is rank {r!r} of a job of {me['size']}"
    if r in conns:
        return f"two processes say they are rank {r}"
    if them.get("host") != me["host"]:
        return (f"rank {r} runs on host {them.get('host')!r}, rank 0 on {me['host']!r}: the ranks of a job without "
                "MPI must share one host")
    return ""


def _join(addr: bytes, me: dict, deadline: float, timeout: float) -> dict:
    while True:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            c.connect(addr)
        except (FileNotFoundError, ConnectionRefusedError):
            c.close()
            if time.monotonic() >= deadline:
                raise FastxferError(
                    f"{me['launcher']}: rank 0 of this host's {me['size']} ranks never opened the job's rendezvous "
                    f"within {timeout:g} s (FASTXFER_ATTACH_TIMEOUT). Did it start, and on this host?") from None
            time.sleep(0.02)
            continue
        try:
            _, uid = peer(c)
            if uid != os.getuid():
                raise FastxferError(
                    f"{me['launcher']}: the process listening at this job's rendezvous belongs to user {uid}, not "
                    "to you: another user took the name. Start the job again (a new step gets a new name)")
            _send(c, me)
            reply = _recv(c, deadline)
        except (TimeoutError, ConnectionError, OSError, ValueError) as e:
            raise FastxferError(f"{me['launcher']}: rank {me['rank']} lost rank 0 during the rendezvous on this host "
                                f"({e or type(e).__name__}); rank 0 reports why") from None
        finally:
            c.close()
        if "error" in reply:
            raise FastxferError(f"{me['launcher']}: {reply['error']}")
        return reply
