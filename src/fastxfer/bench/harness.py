"""The one harness every benchmark uses: timing, the machine description, starting worker modules
and collecting their results, targets, and the output (terminal table, markdown, JSON, plots)."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable

from fastxfer import _safefile

GB = 1e9  # benchmarks report decimal gigabytes, as nccl-tests does


# ---- timing -----------------------------------------------------------------------------------

def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median wall time of fn() over `reps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_call(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU cores busy) of one call of fn: process CPU time / wall time, so that a
    "per core" figure can be checked against what the call really used."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return dt, (time.process_time() - c0) / dt


# ---- the machine ------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def machine_info() -> dict:
    """What every result carries: when, on which CPU, with which versions and which command."""
    import numpy as np

    import fastxfer

    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "cpus": usable_cpus(),
        "simd_level": fastxfer.simd_level(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "fastxfer": fastxfer.__version__,
        "command": " ".join(["fastxfer"] + sys.argv[1:]) if sys.argv and sys.argv[0].endswith("fastxfer")
        else " ".join([os.path.basename(sys.executable)] + sys.argv),
    }


# ---- worker processes -------------------------------------------------------------------------
# Workers are modules under fastxfer.bench.workers. Each writes its result as JSON to `OUT.<rank>`
# (a file rather than stdout: launchers prefix and interleave the workers' output, and peers'
# libraries print to stdout too).

def worker_command(name: str, *args: str) -> list[str]:
    """The command line that runs worker module `name` (e.g. "allreduce_worker") in this Python."""
    return [sys.executable, "-m", f"fastxfer.bench.workers.{name}", *args]


def launcher_command(np_: int, *options: str) -> list[str]:
    """`fastxfer run -np N [options] --`, to be followed by a worker command."""
    return [sys.executable, "-m", "fastxfer.cli", "run", "-np", str(np_), *options, "--"]


def write_result(out: str, rank: int, payload: dict) -> None:
    with open(f"{out}.{rank}", "w") as f:
        json.dump(payload, f)


def read_results(out: str, ranks: int) -> list[dict]:
    """The results of ranks 0..ranks-1, in rank order; ranks that wrote none are left out."""
    got = []
    for rank in range(ranks):
        try:
            with open(f"{out}.{rank}") as f:
                got.append(json.load(f))
        except FileNotFoundError:
            pass
    return got


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (for peers that rendezvous over TCP)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- results ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    op: str
    impl: str
    threads: str
    seconds: float
    elements: int
    bytes_moved: int
    wrong: int | None = None  # elements differing from the reference result; None = not checked
    baseline: str | None = None  # impl this row is compared with
    ratio: float | None = None  # speed-up over the baseline (time_baseline / time_this)

    @property
    def gelem_s(self) -> float:
        return self.elements / self.seconds / GB

    @property
    def gb_s(self) -> float:
        return self.bytes_moved / self.seconds / GB

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(gelem_s=self.gelem_s, gb_s=self.gb_s, ms=self.seconds * 1e3)
        return d


def target(text: str, value: float, need: float, ok: bool) -> dict:
    """One of the issue's targets as evaluated on this run (the form JSON and the reports use)."""
    return {"target": text, "value": value, "need": need, "ok": ok}


# ---- output -----------------------------------------------------------------------------------

def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Repeated sweeps as one: a row per (impl, bytes, collective) with the median over the runs of
    each run's p50 (and wire bytes, where rows have them) and every run's wrong elements added up;
    `p50s` keeps each run's p50, in run order. Rows keep the first run's other fields and order."""
    out: dict[tuple, dict] = {}
    for rows in runs:
        for r in rows:
            key = (r["impl"], r["bytes"], r.get("collective"))
            o = out.setdefault(key, dict(r, p50s=[], wires=[], wrong=0))
            o["p50s"].append(r["p50"])
            o["wrong"] += r["wrong"]
            if r.get("wire_bytes") is not None:
                o["wires"].append(r["wire_bytes"])
    for o in out.values():
        o["p50"] = float(statistics.median(o["p50s"]))
        if o["wires"]:
            o["wire_bytes"] = float(statistics.median(o["wires"]))
        del o["wires"]
    return list(out.values())


def status(msg: str) -> None:
    """One line of progress on stderr (keeps stdout clean for --json -)."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def print_table(title: str, columns: list[str], rows: list[list[str]], caption: str = "") -> None:
    """A table on the terminal (rich when installed, plain text otherwise)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}")
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
        for r in rows:
            print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
        if caption:
            print(caption)
        return
    t = Table(title=title, caption=caption or None)
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i < 2 else "right")
    for r in rows:
        t.add_row(*r)
    # piped or captured: as wide as the table needs, not the 80 columns rich assumes without a terminal
    Console(width=None if sys.stdout.isatty() else 200).print(t)


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def print_markdown(machine: dict, caption: str, columns: list[str], rows: list[list[str]],
                   targets: list[dict] | None = None) -> None:
    """The block a benchmark prints for bench/RESULTS.md: command, machine line, table, targets."""
    print(f"\nCommand: `{machine['command']}`  \n{caption}\n")
    print(markdown_table(columns, rows))
    if targets:
        print()
        for t in targets:
            print(f"- {'PASS' if t['ok'] else 'MISS'}: {t['target']}: {t['value']:.2f} (need {t['need']:g})")


def print_targets(targets: list[dict]) -> None:
    for t in targets:
        print(f"  [{'PASS' if t['ok'] else 'MISS'}] {t['target']}: {t['value']:.2f} (need {t['need']:g})")


def write_json(path: str, payload: dict) -> None:
    """The results as JSON to `path`, or to stdout when path is "-"."""
    text = json.dumps(payload, indent=2)
    if path == "-":
        print(text)
    else:
        _safefile.write(path, text + "\n")


def pyplot():
    """matplotlib.pyplot drawing to files (Agg), or None, said on stderr, when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        status("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    return plt


def save_plot(fig, path: str, dpi: int = 110) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    status(f"plot written to {path}")
