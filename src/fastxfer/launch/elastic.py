"""``fastxfer run -np N --min-np M [--max-np K] [--max-restarts R]``: an elastic job on this host.

The job goes on while at least M workers remain. When a worker fails (a non-zero exit, a signal),
the survivors' collectives raise PeerFailureError within a second; inside ``elastic.run`` they
restore their last commit, leave the old group and ask the launcher to join the next generation
(comm/rendezvous.py). The launcher forms it from the survivors, in their old rank order, so rank 0
stays rank 0 unless it is the one that died. With ``--max-restarts R`` the launcher also starts a
new worker in the failed one's place (R times in all over the job); it waits to join, the members
see it at their next ``state.commit()`` and form a generation with it, and it receives rank 0's
state there. ``--max-np`` caps a generation's size.

The job ends when every worker has exited. Its exit code is 0 when the last generation's members
all exited 0 -- failures the job recovered from are listed in the last lines, not fatal -- and
otherwise the first failure's. When fewer than M workers remain (and no restart is left), the
rest are stopped as `fastxfer run` stops a failed job, and the last line names every failure.
A member that does not come back to the rendezvous within FASTXFER_ELASTIC_TIMEOUT seconds
(default: FASTXFER_TIMEOUT, else 300) after a failure is treated as stalled: it is killed and the
generation forms without it. The first generation waits as long as the workers take to reach init().

Workers' output is prefixed with their worker number: 0..N-1 for the first ones, N, N+1, ... for
restarted ones (a worker's rank can change from one generation to the next; its number does not).
"""

from __future__ import annotations

import os
import shutil
import signal
import time

from fastxfer import settings
from fastxfer.comm import segments
from fastxfer.comm.rendezvous import SOCKET_ENV, WORKER_ENV, Rendezvous
from fastxfer.launch import output
from fastxfer.launch.job import STOP_SIGNALS, Job, Stopper, die_with_parent
from fastxfer.launch.output import describe_exit, say


class ElasticJob(Job):
    """Workers of an elastic job: their ranks come from the rendezvous, generation by generation;
    worker w's output is prefixed with [w]."""

    def __init__(self, np_: int, command: list[str], grace: float, min_np: int, max_np: int, max_restarts: int,
                 placement: list[dict] | None = None, timeout: float | None = None, output_dir: str | None = None):
        super().__init__(np_, command, grace, placement=placement, output_dir=output_dir)
        if timeout is None:  # as long as a silent peer may take before the engine gives up on it
            timeout = settings.get("FASTXFER_ELASTIC_TIMEOUT")  # FASTXFER_TIMEOUT when unset
        self.min_np, self.max_np, self.restarts_left = min_np, max_np, max_restarts
        # the first generation waits FASTXFER_ATTACH_TIMEOUT for each started worker to reach init()
        self.rdzv = Rendezvous(self.secret, self.report_dir, min_np, max_np, timeout,
                               start_timeout=settings.get("FASTXFER_ATTACH_TIMEOUT"))
        self.killed_stopped: set[int] = set()
        self.killed_late: set[int] = set()
        self.slots: dict[int, int] = {}      # worker -> placement slot
        self.failures: list[str] = []        # "worker 2 (rank 2 of generation 0): killed by SIGKILL"
        self.handled: set[int] = set()
        self.killed_stalled: set[int] = set()
        self.finishing = False
        self.dismissed: set[int] = set()     # newcomers stopped because the job finished first
        self.resumed: list[float] = []       # seconds from a failure to the next generation

    def worker_env(self, slot: int, worker: int) -> dict[str, str]:
        env = self.base_env(slot)
        env.update({
            SOCKET_ENV: self.rdzv.path,
            WORKER_ENV: str(worker),
            "FASTXFER_JOB_ID": self.job_id,
            "FASTXFER_REPORT_DIR": self.report_dir,
            "FASTXFER_JOB_SECRET": self.secret,
            "PYTHONUNBUFFERED": "1",
        })
        for k in ("FASTXFER_RANK", "FASTXFER_SIZE", "FASTXFER_LOCAL_RANK", "FASTXFER_LOCAL_SIZE"):
            env.pop(k, None)  # the rendezvous assigns them, generation by generation
        for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
                  "HOROVOD_CROSS_SIZE"):
            env.pop(k, None)  # so do these (hvd.rank() after init() is the truth in an elastic job)
        return env

    def start(self) -> None:
        self.rdzv.serve()
        self.rdzv.expect_first([str(w) for w in range(self.np)])
        preexec = die_with_parent(os.getpid())
        for w in range(self.np):
            if self.interrupted is not None:
                break
            self._start_worker(w, w, preexec)

    def _start_worker(self, worker: int, slot: int, preexec) -> None:
        self.slots[worker] = slot
        p = self.spawn(worker, preexec, slot=slot)
        self.rdzv.started(str(worker), p.pid)

    def _where(self, worker: int) -> str:
        """'rank r of generation g' for a member of some generation, else 'not yet in the group'."""
        for gen in reversed(self.rdzv.history):
            if str(worker) in gen.members:
                return f"rank {gen.members.index(str(worker))} of generation {gen.number}"
        return "not yet in the group"

    def wait(self) -> int:
        self.catch_stop_signals()
        preexec = die_with_parent(os.getpid())
        stopper = Stopper(self, "worker")
        failed_job: str | None = None
        failure_at: float | None = None
        gen_seen = 0
        try:
            while len(self.exit_times) < len(self.procs):
                now = time.monotonic()
                with self.lock:
                    exited = [w for w in self.exit_times if w not in self.handled]
                for w in sorted(exited, key=lambda w: self.exit_times[w]):
                    self.handled.add(w)
                    code = self.procs[w].returncode
                    failed = code != 0
                    if w in self.killed_stopped:
                        why = "was stopped (SIGSTOP) when the group re-formed: killed"
                    elif w in self.killed_late:
                        why = "did not reach fastxfer.init() in time: killed"
                    elif w in self.killed_stalled:
                        why = "did not come back to the rendezvous in time: killed"
                    else:
                        why = describe_exit(code)
                    if failed and w in self.dismissed:
                        pass  # a newcomer stopped because the job finished before it could join
                    elif failed and str(w) not in self.rdzv.members() + (self.rdzv.expected or []):
                        self.failures.append(f"worker {w} (not yet in the group): {why}")
                        with self.lock:
                            say(f"fastxfer run: worker {w} failed before joining the group ({why})")
                        self._restart(w, preexec)
                    elif failed:
                        self.failures.append(f"worker {w} ({self._where(w)}): {why}")
                        with self.lock:
                            say(f"fastxfer run: worker {w} ({self._where(w)}) failed ({why})")
                        if failure_at is None:
                            failure_at = now
                        self._restart(w, preexec)
                    elif not failed and str(w) in self.rdzv.members():
                        self.finishing = True  # a member finished: the job is ending, no restarts
                    self.rdzv.exited(str(w), failed)
                    alive = len(self.rdzv.alive)
                    if failed and failed_job is None and alive < self.min_np and not self.finishing \
                            and stopper.stop_at is None:
                        failed_job = (f"{alive} worker(s) left, fewer than --min-np {self.min_np}")
                        with self.lock:
                            say(f"fastxfer run: {failed_job}; giving the others {self.grace:g} s to stop")
                        stopper.stop_at = now + self.grace
                gen = self.rdzv.current
                if gen is not None and gen.number != gen_seen and gen.number > 0:
                    gen_seen = gen.number
                    if failure_at is not None:
                        # from when the group stopped making progress: its members' last commit
                        # (a stopped or hung worker's exit comes only when it is killed)
                        self.resumed.append(gen.formed_at - min(failure_at, gen.began or failure_at))
                        failure_at = None
                    with self.lock:
                        say(f"fastxfer run: generation {gen.number}: {len(gen.members)} worker(s) "
                            f"(workers {', '.join(gen.members)} as ranks 0..{len(gen.members) - 1})")
                    self._remove_segment(gen.number - 1)
                first = self.rdzv.current is None
                for w in self.rdzv.overdue():
                    wi = int(w)
                    if wi not in self.killed_stalled | self.killed_late and self.procs[wi].poll() is None:
                        if first:
                            self.killed_late.add(wi)
                            msg = (f"worker {w} did not reach fastxfer.init() within {self.rdzv.start_timeout:g} s "
                                   "of its start (FASTXFER_ATTACH_TIMEOUT, --start-timeout): killing it")
                        else:
                            self.killed_stalled.add(wi)
                            msg = f"worker {w} did not rejoin within {self.rdzv.timeout:g} s: killing it"
                        self._kill(wi, msg)
                for w in self.rdzv.stopped():
                    wi = int(w)
                    if wi not in self.killed_stopped and self.procs[wi].poll() is None:
                        self.killed_stopped.add(wi)
                        self._kill(wi, f"worker {w} is stopped (SIGSTOP) and cannot rejoin: killing it")
                if self.finishing and not any(self.procs[int(m)].poll() is None for m in self.rdzv.members()):
                    # the members are done: workers that are not members (restarted ones, waiting to
                    # join or still starting) have nothing left to join
                    self.rdzv.close("the job finished before this worker could join it")
                    for w in list(self.rdzv.alive):
                        wi = int(w)
                        if wi not in self.dismissed and self.procs[wi].poll() is None:
                            self.dismissed.add(wi)
                            try:
                                os.killpg(self.procs[wi].pid, signal.SIGTERM)
                            except (ProcessLookupError, PermissionError):
                                pass
                stopper.tick(now, before_term=lambda: self.rdzv.close("the job is stopping"))
                time.sleep(0.02)
            for t in self.pumps:
                t.join(timeout=5)
        finally:
            self.rdzv.close("the job has ended")
            self.restore_signals()
            segments.remove_segments_of(os.getpid())
            shutil.rmtree(self.report_dir, ignore_errors=True)
        return self._verdict(failed_job)

    def _kill(self, worker: int, message: str) -> None:
        with self.lock:
            say(f"fastxfer run: {message}")
        try:
            os.killpg(self.procs[worker].pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _restart(self, failed: int, preexec) -> None:
        """A new worker in the failed one's place, while restarts are left (--max-restarts)."""
        if self.restarts_left > 0 and not self.finishing and self.interrupted is None:
            self.restarts_left -= 1
            nw = len(self.procs)
            with self.lock:
                say(f"fastxfer run: starting worker {nw} in its place ({self.restarts_left} restart(s) left)")
            self._start_worker(nw, self.slots[failed], preexec)

    def _remove_segment(self, generation: int) -> None:
        """The old generation's segment, if a rank that died left it behind."""
        name = segments.job_segment_name(os.getpid(), self.job_id, self.secret, generation)
        try:
            os.unlink(segments.path(name))
        except OSError:
            pass

    def _verdict(self, failed_job: str | None) -> int:
        recovered = "; ".join(self.failures)
        if self.interrupted is not None:
            output.say_stopped(STOP_SIGNALS[self.interrupted], "worker", self.procs)
            return 128 + self.interrupted
        last = self.rdzv.history[-1] if self.rdzv.history else None
        if failed_job is None and last is not None:
            codes = {m: self.procs[int(m)].returncode for m in last.members}
            bad = {m: c for m, c in codes.items() if c != 0}
            if not bad:
                msg = (f"fastxfer run: elastic job finished with {len(last.members)} worker(s) "
                       f"(generation {last.number})")
                if self.failures:
                    msg += f"; recovered from {len(self.failures)} failure(s): {recovered}"
                if self.resumed:
                    msg += ("; training resumed " + ", ".join(f"{s:.1f} s" for s in self.resumed) +
                            " after the last commit before them")
                say(msg)
                return 0
            m, code = sorted(bad.items(), key=lambda kv: self.exit_times.get(int(kv[0]), 0))[0]
            if not self.failures:
                self.failures.append(f"worker {m} ({self._where(int(m))}): {describe_exit(code)}")
                recovered = self.failures[0]
        elif last is None and failed_job is None:
            failed_job = ("no generation was formed: the workers never called fastxfer.init() (an elastic job's "
                          "workers join the group there)")
        why = failed_job or "a worker of the last generation failed"
        first = min(((self.exit_times[i], p.returncode) for i, p in enumerate(self.procs)
                     if p.returncode not in (None, 0) and i in self.exit_times), default=(0, 1))[1]
        say(f"fastxfer run: elastic job failed: {why}; failures: {recovered or 'none recorded'}")
        return output.exit_code(first) or 1


def run(np_: int, command: list[str], grace: float, min_np: int, max_np: int, max_restarts: int,
        placement: list[dict] | None = None, output_dir: str | None = None) -> int:
    """Runs `command` as an elastic job of N workers (min_np..max_np, max_restarts restarts in all);
    returns the job's exit code."""
    return ElasticJob(np_, command, grace, min_np, max_np, max_restarts, placement=placement,
                      output_dir=output_dir).run()
