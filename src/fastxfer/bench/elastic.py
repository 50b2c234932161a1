"""``fastxfer bench elastic``: how long an elastic job stands still when a worker is killed.

Each trial starts `fastxfer run -np 3 --min-np 2` with a small Keras CNN trained under
fastxfer's elastic.run (bench/workers/elastic_worker.py, a commit every step), waits until every
worker has trained a few steps, kills worker 2 with SIGKILL and reads the survivors' event logs
(one clock for all processes: CLOCK_MONOTONIC): from the kill to the group re-formed (the reset
callback runs) and to the first training step finished in the new generation. The peer, in the
same run, is what a job without elastic mode costs at the least: a new 2-worker job started from
scratch until its first step is done (interpreter, TensorFlow, init, tracing; the lost steps since
the last checkpoint and loading it come on top). Medians over the trials, and their ratio.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time

from fastxfer.bench.harness import (launcher_command, machine_info, print_markdown, print_table, status,
                                    worker_command, write_json)


def _events(d: str) -> dict[str, list[dict]]:
    out = {}
    for path in glob.glob(os.path.join(d, "events.*")):
        with open(path) as f:
            out[path.rsplit(".", 1)[1]] = [json.loads(line) for line in f if line.strip()]
    return out


def _env() -> dict:
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
                TF_NUM_INTEROP_THREADS="1")


def elastic_trial(steps: int, warm: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="fastxfer-elastic-") as d:
        cmd = launcher_command(3, "--min-np", "2") + worker_command("elastic_worker", "--out", d, "--steps", str(steps))
        p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        t_kill = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and p.poll() is None:
            ev = _events(d)
            done = [max((e.get("steps", 0) for e in ev.get(w, []) if e["ev"] == "step"), default=0) for w in "012"]
            if min(done) >= warm:
                pid = next(e["pid"] for e in ev["2"] if e["ev"] == "pid")
                t_kill = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.02)
        try:
            _, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            raise SystemExit("the elastic job did not finish in 600 s")
        if p.returncode != 0 or t_kill is None:
            raise SystemExit(f"the elastic job failed (exit {p.returncode}): {err.strip()[-800:]}")
        ev = _events(d)
        resets = [e["t"] for w in "01" for e in ev[w] if e["ev"] == "reset" and e["t"] > t_kill]
        first = [e["t"] for w in "01" for e in ev[w] if e["ev"] == "step" and e["gen"] >= 1]
        before = [e["t"] for e in ev["0"] if e["ev"] == "step" and e["gen"] == 0]
        after = [e["t"] for e in ev["0"] if e["ev"] == "step" and e["gen"] >= 1]
        step_before = statistics.median(b - a for a, b in zip(before, before[1:]))
        step_after = statistics.median(b - a for a, b in zip(after, after[1:]))
        return {"reformed_s": min(resets) - t_kill, "resumed_s": min(first) - t_kill,
                "step_3_ms": step_before * 1e3, "step_2_ms": step_after * 1e3}


def restart_trial() -> dict:
    with tempfile.TemporaryDirectory(prefix="fastxfer-restart-") as d:
        cmd = launcher_command(2) + worker_command("elastic_worker", "--out", d, "--steps", "1", "--plain")
        t0 = time.monotonic()
        r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise SystemExit(f"the plain job failed: {r.stderr.strip()[-800:]}")
        ev = _events(d)
        first = min(e["t"] for w in ev for e in ev[w] if e["ev"] == "step")
        return {"first_step_s": first - t0}


def run(trials: int, steps: int, warm: int) -> dict:
    el, rs = [], []
    for k in range(trials):
        status(f"trial {k + 1}/{trials}: elastic job, worker 2 killed after {warm} steps")
        el.append(elastic_trial(steps, warm))
        status(f"trial {k + 1}/{trials}: a new 2-worker job until its first step")
        rs.append(restart_trial())
    med = {key: statistics.median(t[key] for t in el) for key in el[0]}
    med["restart_first_step_s"] = statistics.median(t["first_step_s"] for t in rs)
    med["ratio"] = med["restart_first_step_s"] / med["resumed_s"]
    return {"machine": machine_info(), "trials": el, "restarts": rs, "median": med}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="training steps of each elastic job")
    p.add_argument("--warm", type=int, default=8, help="steps every worker trains before the kill")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", action="store_true")


def main(args: argparse.Namespace) -> int:
    if args.warm >= args.steps:
        raise SystemExit("--warm must be below --steps")
    res = run(args.trials, args.steps, args.warm)
    m = res["median"]
    cols = ["what", "median"]
    rows = [["kill -> group re-formed (2 workers)", f"{m['reformed_s']:.2f} s"],
            ["kill -> first step done in the new group", f"{m['resumed_s']:.2f} s"],
            ["a new 2-worker job -> its first step done", f"{m['restart_first_step_s']:.2f} s"],
            ["restart / elastic resume", f"{m['ratio']:.1f}x"],
            ["step, 3 workers / 2 workers", f"{m['step_3_ms']:.0f} / {m['step_2_ms']:.0f} ms"]]
    caption = (f"{args.trials} trials; fastxfer run -np 3 --min-np 2, worker 2 killed with SIGKILL after "
               f"{args.warm} steps")
    print_table("elastic: a worker killed", cols, rows, caption)
    if args.markdown:
        print_markdown(res["machine"], caption, cols, rows)
    if args.json:
        write_json(args.json, res)
    return 0
