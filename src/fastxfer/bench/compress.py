"""``fastxfer bench compress``: float32 <-> bf16/fp16 conversion and fused bucket packing, side by
side with ml_dtypes, numpy, tf.cast and torch (where installed) and with a plain copy of the
same bytes, which is the memory-bandwidth limit.

Every implementation converts the same 64 MB (by default) of normally distributed float32; each
result is checked bit for bit against ml_dtypes (bf16) / numpy (fp16), the ``#wrong`` column.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np

import fastxfer as fx
from fastxfer.bench.harness import (Row, machine_info, median_seconds, print_markdown, print_table, print_targets,
                                    pyplot, read_results, save_plot, status, target, usable_cpus, worker_command,
                                    write_json)
from fastxfer.fusion import BucketPlanner, pack

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)


def _mismatches(got, want) -> int:
    g = np.asarray(got).reshape(-1)
    w = np.asarray(want).reshape(-1)
    width = {2: np.uint16, 4: np.uint32}[w.dtype.itemsize]
    return int(np.count_nonzero(g.view(width) != w.view(width)))


# ---- peers --------------------------------------------------------------------------------------

def _tf_times(threads: int, n: int, reps: int) -> dict | None:
    """tf.cast timings from a child process (TensorFlow's thread pools are fixed at start-up)."""
    try:
        if importlib.util.find_spec("tensorflow") is None:
            return None
    except ValueError:
        return None
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    with tempfile.TemporaryDirectory(prefix="fastxfer-bench-") as tmp:
        out = os.path.join(tmp, "tf")
        r = subprocess.run(worker_command("compress_worker", "--threads", str(threads), "--elements", str(n),
                                          "--reps", str(reps), "--out", out),
                           env=env, capture_output=True, text=True, timeout=900)
        got = read_results(out, 1)
    if r.returncode == 0 and got:
        return got[0]
    status(f"tf.cast peer failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:] or ''}")
    return None


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


# ---- the benchmark -------------------------------------------------------------------------

def run(size_mb: float = 64, reps: int = 11, threads: list[int] | None = None, pack_mb: float = 100,
        pack_tensors: int = 100, peers: bool = True) -> dict:
    all_cpus = usable_cpus()
    threads = threads or sorted({1, all_cpus})
    n = int(size_mb * 1e6 / 4) // 64 * 64
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    ref_b = x.astype(BF16)
    ref_h = x.astype(F16)
    ref_b32 = ref_b.astype(np.float32)
    ref_h32 = ref_h.astype(np.float32)
    out_b, out_h, out32 = np.empty(n, BF16), np.empty(n, F16), np.empty(n, np.float32)
    rows: list[Row] = []
    torch = _torch() if peers else None
    peers_used = {"ml_dtypes": ml_dtypes.__version__, "numpy": np.__version__}

    def add(op, impl, t, fn, nbytes, check=None, want=None, baseline=None):
        sec = median_seconds(fn, reps)
        wrong = _mismatches(check(), want) if check is not None else None
        rows.append(Row(op, impl, str(t), sec, n, nbytes, wrong, baseline))
        return sec

    for t in threads:
        status(f"threads={t}: copy and conversions of {n * 4 / 1e6:.0f} MB float32")
        # The bandwidth limit: the same bytes copied, read once and written once.
        if t == 1:
            add("copy f32", "numpy.copyto", t, lambda: np.copyto(out32, x), 8 * n)
        (copy_bucket,) = BucketPlanner(1 << 62, 1 << 62).plan([x])
        add("copy f32", "fastxfer threaded copy", t, lambda: pack(copy_bucket, [x], out=out32, threads=t), 8 * n)

        for op, kind, ref, lib, lib_name in (("f32->bf16", "bf16", ref_b, BF16, "ml_dtypes"),
                                             ("f32->fp16", "fp16", ref_h, F16, "numpy")):
            out = out_b if kind == "bf16" else out_h
            add(op, "fastxfer (out=)", t, lambda: fx.compress(x, kind, out=out, threads=t), 6 * n,
                lambda: out, ref, baseline=f"{lib_name} astype")
            add(op, "fastxfer (new array)", t, lambda: fx.compress(x, kind, threads=t), 6 * n,
                lambda: fx.compress(x, kind, threads=t), ref, baseline=f"{lib_name} astype")
            if t == 1:
                add(op, f"{lib_name} astype", t, lambda: x.astype(lib), 6 * n, lambda: x.astype(lib), ref)
                add(op, f"{lib_name} copyto (out=)", t, lambda: np.copyto(out, x, casting="unsafe"), 6 * n,
                    lambda: out, ref)
            if torch is not None:
                torch.set_num_threads(t)
                tx = torch.from_numpy(x)
                tdt = torch.bfloat16 if kind == "bf16" else torch.float16
                add(op, "torch .to", t, lambda: tx.to(tdt), 6 * n,
                    lambda: tx.to(tdt).view(torch.int16).numpy().view(np.uint16), ref.view(np.uint16))

        for op, src, want, lib_name in (("bf16->f32", ref_b, ref_b32, "ml_dtypes"),
                                        ("fp16->f32", ref_h, ref_h32, "numpy")):
            add(op, "fastxfer (out=)", t, lambda: fx.decompress(src, out=out32, threads=t), 6 * n,
                lambda: out32, want, baseline=f"{lib_name} astype")
            if t == 1:
                add(op, f"{lib_name} astype", t, lambda: src.astype(np.float32), 6 * n,
                    lambda: src.astype(np.float32), want)
            if torch is not None:
                torch.set_num_threads(t)
                ts = torch.from_numpy(src.view(np.int16)).view(torch.bfloat16 if op == "bf16->f32" else torch.float16)
                add(op, "torch .to", t, lambda: ts.to(torch.float32), 6 * n,
                    lambda: ts.to(torch.float32).numpy(), want)

        if peers:
            status(f"threads={t}: tf.cast (child process, intra-op threads={t})")
            tf = _tf_times(t, n, reps)
            if tf is not None:
                peers_used["tensorflow"] = tf["version"]
                stride = max(1, n // 65536)
                for op in ("f32->bf16", "f32->fp16", "bf16->f32", "fp16->f32"):
                    wrong = None
                    if op in tf["bits"]:
                        want = (ref_b if op == "f32->bf16" else ref_h).view(np.uint16)[::stride]
                        wrong = int(np.count_nonzero(np.array(tf["bits"][op], np.uint16) != want)) * stride
                    rows.append(Row(op, "tf.cast", str(t), tf[op], n, 6 * n, wrong))

        # Fused pack: 100 tensors of uneven sizes totalling pack_mb, packed into one bf16 bucket,
        # against one memcpy of the same float32 bytes.
        status(f"threads={t}: pack {pack_tensors} tensors ({pack_mb:.0f} MB) with bf16 compression")
        total = int(pack_mb * 1e6 / 4)
        w = rng.uniform(0.2, 1.8, pack_tensors)
        sizes = np.maximum(1, (w / w.sum() * total).astype(np.int64))
        big = rng.standard_normal(int(sizes.sum())).astype(np.float32)
        tensors = np.split(big, np.cumsum(sizes)[:-1])
        (bucket,) = BucketPlanner(1 << 62, 1 << 62, "bf16").plan(tensors)
        packed = np.empty(bucket.numel, BF16)
        big_out = np.empty_like(big)
        m = big.size
        if t == 1:
            label, copy_fn = "memcpy f32 (numpy.copyto)", lambda: np.copyto(big_out, big)
        else:
            (copy_big,) = BucketPlanner(1 << 62, 1 << 62).plan([big])
            label, copy_fn = "threaded copy f32", lambda: pack(copy_big, [big], out=big_out, threads=t)
        memcpy = median_seconds(copy_fn, reps)
        rows.append(Row("pack 100 tensors", label, str(t), memcpy, m, 8 * m))
        sec = median_seconds(lambda: pack(bucket, tensors, out=packed, threads=t), reps)
        pk = Row("pack 100 tensors", "fastxfer pack+bf16", str(t), sec, m, 6 * m)
        pk.wrong = sum(_mismatches(packed[o:o + s.size], s.astype(BF16)) for o, s in zip(bucket.offsets, tensors))
        pk.baseline, pk.ratio = rows[-1].impl, memcpy / sec
        rows.append(pk)

    # ratios against the reference library at one thread
    base = {(r.op, r.impl): r.seconds for r in rows if r.threads == "1"}
    for r in rows:
        if r.baseline and r.ratio is None and (r.op, r.baseline) in base:
            r.ratio = base[(r.op, r.baseline)] / r.seconds
    return {"machine": machine_info(), "peers": peers_used, "elements": n, "rows": [r.as_dict() for r in rows],
            "targets": _targets(rows)}


def _find(rows, op, impl, t="1"):
    for r in rows:
        if r.op == op and r.impl == impl and r.threads == t:
            return r
    return None


def _targets(rows: list[Row]) -> list[dict]:
    """The issue's targets, evaluated on this run (single thread unless stated)."""
    out = []
    copy = _find(rows, "copy f32", "numpy.copyto")
    fb, fh = _find(rows, "f32->bf16", "fastxfer (out=)"), _find(rows, "f32->fp16", "fastxfer (out=)")
    ml = [r for r in (_find(rows, "f32->bf16", "ml_dtypes astype"), _find(rows, "f32->bf16", "ml_dtypes copyto (out=)")) if r]
    npy = [r for r in (_find(rows, "f32->fp16", "numpy astype"), _find(rows, "f32->fp16", "numpy copyto (out=)")) if r]
    if fb and ml:
        speedup = min(r.seconds for r in ml) / fb.seconds
        out.append(target("f32->bf16, 1 thread, >= 5x ml_dtypes (its faster form)", speedup, 5.0, speedup >= 5.0))
    if fb and copy:
        frac = fb.gb_s / copy.gb_s
        out.append(target("f32->bf16, 1 thread, >= 80% of copy bandwidth (bytes moved)", frac, 0.8, frac >= 0.8))
    if fh and npy:
        speedup = min(r.seconds for r in npy) / fh.seconds
        out.append(target("f32->fp16, 1 thread, >= 5x numpy (its faster form)", speedup, 5.0, speedup >= 5.0))
    for r in rows:
        if r.op == "pack 100 tensors" and r.impl == "fastxfer pack+bf16":
            slow = 1 / r.ratio
            out.append(target(f"pack+bf16 of 100 tensors within 1.2x one memcpy (threads={r.threads})", slow, 1.2,
                              slow <= 1.2))
    return out


COLUMNS = ["op", "implementation", "threads", "median ms", "Gelem/s", "GB/s moved", "speed-up", "#wrong"]


def _cells(d: dict) -> list[str]:
    return [d["op"], d["impl"], d["threads"], f"{d['ms']:.2f}", f"{d['gelem_s']:.2f}", f"{d['gb_s']:.1f}",
            f"{d['ratio']:.1f}x vs {d['baseline']}" if d["ratio"] else "",
            "" if d["wrong"] is None else str(d["wrong"])]


def report(result: dict, markdown: bool = False) -> None:
    m = result["machine"]
    caption = (f"{m['date']} | {m['cpu']} | {m['cpus']} CPUs | fastxfer {m['fastxfer']} path {m['simd_level']} | "
               f"peers: {', '.join(f'{k} {v}' for k, v in result['peers'].items())} | GB = 1e9 B; GB/s counts "
               "bytes read + written; medians")
    rows = [_cells(d) for d in result["rows"]]
    print_table(f"fastxfer bench compress: {result['elements'] * 4 / 1e6:.0f} MB float32", COLUMNS, rows, caption)
    print_targets(result["targets"])
    if markdown:
        print_markdown(m, caption, COLUMNS, rows, result["targets"])


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    ncol = 3
    nrow = (len(ops) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(15, 3.6 * nrow), squeeze=False)
    for ax in axes.flat[len(ops):]:
        ax.axis("off")
    for ax, op in zip(axes.flat, ops):
        sel = [r for r in rows if r["op"] == op]
        labels = [f"{r['impl']} t{r['threads']}" for r in sel]
        colors = ["tab:blue" if r["impl"].startswith("fastxfer") else "tab:gray" for r in sel]
        ax.barh(labels, [r["gb_s"] for r in sel], color=colors)
        ax.set_title(op)
        ax.set_xlabel("GB/s moved (read + write)")
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
    m = result["machine"]
    fig.suptitle(f"fastxfer bench compress - {m['cpu']}, {m['cpus']} CPUs, {m['date']}", fontsize=9)
    save_plot(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=float, default=64, help="float32 input size in MB (default 64)")
    p.add_argument("--reps", type=int, default=11, help="timed repetitions per measurement (median reported)")
    p.add_argument("--threads", default=None,
                   help="comma-separated thread counts (default: 1 and every usable CPU)")
    p.add_argument("--pack-mb", type=float, default=100, help="total size of the packed tensors (default 100)")
    p.add_argument("--no-peers", action="store_true", help="skip torch and tf.cast")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (- for stdout)")
    p.add_argument("--plot", metavar="PNG", help="draw GB/s per implementation")
    p.add_argument("--markdown", action="store_true", help="also print a markdown table (for bench/RESULTS.md)")


def main(args: argparse.Namespace) -> int:
    threads = [int(t) for t in args.threads.split(",")] if args.threads else None
    if args.reps < 1:
        raise SystemExit("--reps must be >= 1")
    result = run(size_mb=args.size_mb, reps=args.reps, threads=threads, pack_mb=args.pack_mb,
                 peers=not args.no_peers)
    if args.json:
        write_json(args.json, result)
    if args.json != "-":
        report(result, markdown=args.markdown)
    if args.plot:
        plot(result, args.plot)
    wrong = sum(r["wrong"] or 0 for r in result["rows"] if r["impl"].startswith("fastxfer"))
    if wrong:
        print(f"fastxfer produced {wrong} wrong elements", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.compress", description=__doc__)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
