"""``fastxfer bench timeline PATH``: draw one training step of a timeline (FASTXFER_TIMELINE, or
``fastxfer bench train --timeline``) as a picture: the engine thread's lane (idle, negotiation,
buckets) above one lane per tensor (queued -> waiting for its bucket -> reduced), between the
step's begin and end marks. Also prints what the step spent where.

    fastxfer bench timeline /tmp/tl.json --step 5 --png docs/timeline_resnet50.png
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a timeline file (Chrome-trace JSON written by fastxfer)")
    p.add_argument("--step", type=int, default=-1, help="which marked step (default: the middle one)")
    p.add_argument("--plot", metavar="PNG", help="write the picture here (needs matplotlib)")
    p.add_argument("--png", dest="plot", help=argparse.SUPPRESS)  # its first spelling, kept working
    p.add_argument("--title", default="", help="the picture's title")
    p.add_argument("--rank", type=int, default=0, help="whose row of the job's timeline (default 0)")


def load(path: str, rank: int = 0) -> list[dict]:
    """The events of `rank`'s row of a job's timeline (one file, a row per rank: comm/timeline.py)."""
    with open(path) as f:
        events = json.load(f)
    mine = [e for e in events if e.get("pid", rank) == rank]
    if events and not mine:
        raise SystemExit(f"the timeline has no row for rank {rank} (ranks {sorted({e.get('pid') for e in events})})")
    return mine


def step_window(events: list[dict], step: int) -> tuple[int, float, float]:
    """(step, begin, end) in microseconds from the step marks."""
    begins = {e["name"].split()[1]: e["ts"] for e in events if e["ph"] == "i" and e["name"].endswith("begins")}
    ends = {e["name"].split()[1]: e["ts"] for e in events if e["ph"] == "i" and e["name"].endswith("ends")}
    steps = sorted(int(k) for k in begins if k in ends)
    if not steps:
        raise SystemExit("the timeline has no step marks (fastxfer.keras marks model.fit's steps)")
    if step < 0:
        step = steps[len(steps) // 2]
    if step not in steps:
        raise SystemExit(f"no step {step} in the timeline (steps {steps[0]}..{steps[-1]})")
    return step, begins[str(step)], ends[str(step)]


def summarize(events: list[dict], t0: float, t1: float) -> dict:
    """Engine busy/idle time inside [t0, t1], buckets, and when the last reduction ended."""
    inside = [e for e in events if e["ph"] == "X" and e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    engine = [e for e in inside if e["tid"] == 0]
    clip = lambda e: max(0.0, min(e["ts"] + e["dur"], t1) - max(e["ts"], t0))  # noqa: E731
    buckets = [e for e in engine if e["name"].startswith("bucket")]
    reduces = [e for e in inside if e["tid"] != 0 and e["cat"] == "tensor" and e["name"] == "allreduce"]
    first_submit = min((e["ts"] for e in inside if e["tid"] != 0 and e["name"] == "queued"), default=t0)
    return {
        "step_ms": (t1 - t0) / 1e3,
        "buckets": len(buckets),
        "bucket_ms": sum(clip(e) for e in buckets) / 1e3,
        "negotiate_ms": sum(clip(e) for e in engine if e["name"] == "negotiate") / 1e3,
        "idle_ms": sum(clip(e) for e in engine if e["name"] == "idle") / 1e3,
        "tensors": len({e["tid"] for e in reduces}),
        "first_submit_ms": (first_submit - t0) / 1e3,
        "last_reduce_end_ms": (max((e["ts"] + e["dur"] for e in reduces), default=t0) - t0) / 1e3,
    }


def draw(events: list[dict], t0: float, t1: float, png: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inside = [e for e in events if e["ph"] == "X" and e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    tids = sorted({e["tid"] for e in inside if e["tid"] != 0}, key=lambda t: min(e["ts"] for e in inside
                                                                                 if e["tid"] == t))
    rows = [0, None, None, None] + tids  # a gap under the engine's lane
    colors = {"idle": "#dddddd", "negotiate": "#f0a030", "queued": "#9ecae1", "wait": "#fdd0a2",
              "allreduce": "#3182bd", "broadcast": "#31a354", "allgather": "#31a354"}
    fig, ax = plt.subplots(figsize=(11, min(7.0, 2 + 0.03 * len(rows))))
    for y, tid in enumerate(rows):
        if tid is None:
            continue
        for e in (e for e in inside if e["tid"] == tid):
            a, b = max(e["ts"], t0), min(e["ts"] + e["dur"], t1)
            c = "#08519c" if e["name"].startswith("bucket") else colors.get(e["name"], "#999999")
            ax.barh(y, (b - a) / 1e3, left=(a - t0) / 1e3, height=4.0 if tid == 0 else 0.9, color=c, linewidth=0)
    ax.set_yticks([0, len(rows) - 1])
    ax.set_yticklabels(["engine", f"{len(tids)} tensors (first submitted at top)"], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel("ms since the step began")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#dddddd", "#f0a030", "#08519c", "#9ecae1", "#fdd0a2",
                                                              "#3182bd")]
    ax.legend(handles, ["engine idle", "negotiation", "bucket (engine)", "tensor queued", "waiting for bucket",
                        "tensor reduced"], fontsize=7, loc="lower right", ncol=3)
    ax.set_title(title or "one training step", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    events = load(args.path, args.rank)
    step, t0, t1 = step_window(events, args.step)
    s = summarize(events, t0, t1)
    print(f"step {step}: {s['step_ms']:.1f} ms; {s['tensors']} tensors in {s['buckets']} buckets; engine busy in "
          f"buckets {s['bucket_ms']:.1f} ms, negotiating {s['negotiate_ms']:.1f} ms, idle {s['idle_ms']:.1f} ms; "
          f"first gradient submitted at {s['first_submit_ms']:.1f} ms, last reduction ended at "
          f"{s['last_reduce_end_ms']:.1f} ms")
    if args.plot:
        draw(events, t0, t1, args.plot, args.title)
        print(f"picture: {args.plot}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.timeline", description=__doc__)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
