"""``fastxfer run -np N``: N workers started as processes on this host, ranks 0..N-1, the job
stopped when one of them fails and its last line and exit code naming the rank that failed first."""

from __future__ import annotations

import os
import shutil
import time

from fastxfer.comm import segments
from fastxfer.launch import output
from fastxfer.launch.job import STOP_SIGNALS, Job, Stopper, horovod_place
from fastxfer.launch.output import describe_exit, say


class LocalJob(Job):
    """N ranks of a fixed-size job; rank r is worker r, in placement slot r."""

    def worker_env(self, slot: int, worker: int) -> dict[str, str]:
        env = self.base_env(slot)
        env.update({
            "FASTXFER_RANK": str(slot),
            "FASTXFER_SIZE": str(self.np),
            "FASTXFER_LOCAL_RANK": str(slot),
            "FASTXFER_LOCAL_SIZE": str(self.np),
            "FASTXFER_JOB_ID": self.job_id,
            "FASTXFER_REPORT_DIR": self.report_dir,
            "FASTXFER_JOB_SECRET": self.secret,
            "PYTHONUNBUFFERED": "1",
        })
        env.update(horovod_place(slot, self.np))
        return env

    def first_failure(self) -> tuple[int, int] | None:
        """(rank, return code) of the failed rank that exited earliest (its peers' PeerFailureErrors
        come after), or None."""
        with self.lock:
            failed = [(t, r) for r, t in self.exit_times.items() if self.procs[r].returncode not in (None, 0)]
        if not failed:
            return None
        _, r = min(failed)
        return r, self.procs[r].returncode

    def wait(self) -> int:
        """Waits for every rank; stops the job when one fails or the launcher is told to stop
        (forward SIGTERM to every rank, SIGKILL after KILL_AFTER_S); removes the job's segments.
        Returns the exit code; the last line on stderr says why the job ended when it failed."""
        self.catch_stop_signals()
        stopper = Stopper(self, "rank")
        try:
            while len(self.exit_times) < len(self.procs):
                now = time.monotonic()
                if stopper.stop_at is None:
                    failure = self.first_failure()
                    if failure is not None:
                        r, code = failure
                        with self.lock:
                            say(f"fastxfer run: rank {r} failed ({describe_exit(code)}); "
                                f"giving the other ranks {self.grace:g} s to stop")
                        stopper.stop_at = now + self.grace
                stopper.tick(now)
                time.sleep(0.05)
            for t in self.pumps:
                t.join(timeout=5)
        finally:
            self.restore_signals()
            segments.remove_segments_of(os.getpid())
            reports = output.read_stall_reports(self.report_dir, self.np)
            shutil.rmtree(self.report_dir, ignore_errors=True)
        first = self.first_failure()
        if self.interrupted is not None:
            output.say_stopped(STOP_SIGNALS[self.interrupted], "rank", self.procs)
            return 128 + self.interrupted
        if first is None:
            return 0
        r, code = first
        output.say_failed(self.procs, r, reports)
        return output.exit_code(code)


def run(np_: int, command: list[str], grace: float, placement: list[dict] | None = None,
        output_dir: str | None = None) -> int:
    """Runs `command` as N local ranks (bound per `placement` when given; each rank's output also
    in `output_dir`/rank.R/ when given); returns the job's exit code."""
    return LocalJob(np_, command, grace, placement=placement, output_dir=output_dir).run()
