"""``fastxfer bench allreduce``: nccl-tests-style allreduce benchmark, fastxfer side by side with
torch.distributed (gloo, CPU), mpi4py ``Allreduce`` on the installed MPI (and on Intel MPI, with its
wait mode, and MPICH from their wheels, under their own mpiexec, where found: ``hydra_prefix``), Horovod, and DeepSpeed's
shared-memory allreduce (``deepspeed.comm.inference_all_reduce``, CPU accelerator, in place on
float32 and bfloat16 tensors, each rank pinned to a core and one OpenMP thread: its best setting
here) where installed, all on the same ranks of this host.

fastxfer rows: ``none``/``bf16``/``fp16`` (float32 arrays, that compression, into a reused
``out=``), ``none fresh`` (a new result array per call, dropped before the next: a training
loop), ``bf16 array`` / ``bf16 array fresh`` (ml_dtypes.bfloat16 arrays reduced as they are).

The other collectives (issue 15; ``--collectives``, default all four) get rows of their own:
``<impl> alltoall`` (equal splits), ``<impl> reducescatter`` (sum) and ``<impl> allgather`` for
fastxfer, torch gloo (``all_to_all_single``, ``reduce_scatter_tensor``, ``all_gather_into_tensor``:
a row the backend lacks is left out) and mpi4py (``Alltoall``, ``Reduce_scatter_block``,
``Allgather``); ``bytes`` is each rank's input (a multiple of the rank count in elements), and
busbw = algbw*(n-1)/n for alltoall and reducescatter, algbw*(n-1) for allgather (it receives
(n-1) inputs), as nccl-tests counts them.

Inputs are small integers, so every float32 sum is exact and ``#wrong`` counts elements that
differ from the known result (bf16/fp16 carry small integers exactly too). algbw = bytes / time,
busbw = algbw * 2(n-1)/n, in GB/s (1e9 B); time is the median (p50) over iterations, each
started after a barrier. Also fits an alpha-beta cost model to the runs and predicts allreduce
times for 8 to 1024 ranks over 25/100/400 Gb/s networks, ring vs hierarchical.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from fastxfer.bench.harness import (GB, free_port, launcher_command, machine_info, markdown_table, median_rows,
                                    print_markdown, print_table, print_targets, pyplot, read_results, save_plot,
                                    status, target, worker_command, write_json)
from fastxfer.bench.workers.allreduce_worker import COLLECTIVES, deepspeed_segments


def _sizes(b: int, e: int, f: int) -> list[int]:
    out, s = [], b
    while s <= e:
        out.append(s)
        s *= f
    return out


def _launch(impl: str, np_: int, sizes: list[int], scale: float, tmp: str,
            collectives: tuple[str, ...] = COLLECTIVES, bind: str = "none"
            ) -> tuple[list[dict], str | None, dict[str, str]]:
    """One peer's sweep: (rows, why it did not run or None, {row label: why that row was left out})."""
    os.makedirs(tmp, exist_ok=True)
    out = os.path.join(tmp, f"{impl}-{np_}")
    worker = worker_command("allreduce_worker", "--impl", impl, "--sizes", ",".join(map(str, sizes)),
                            "--iters-scale", str(scale), "--out", out, "--collectives", ",".join(collectives))
    env = dict(os.environ)
    if impl in HYDRA:
        prefix = hydra_prefix(impl)
        label, extra = HYDRA[impl]
        env.update(MPI4PY_LIBMPI=os.path.join(prefix, "lib", "libmpi.so.12"),
                   PATH=f"{os.path.join(prefix, 'bin')}:{env.get('PATH', '')}", **extra)
        worker = worker_command("allreduce_worker", "--impl", "mpi4py", "--sizes", ",".join(map(str, sizes)),
                                "--iters-scale", str(scale), "--out", out, "--collectives", ",".join(collectives))
        cmd = [os.path.join(prefix, "bin", "mpiexec"), "-n", str(np_)] + worker
    elif impl == "mpi4py":
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            return [], "mpirun not on PATH", {}
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
        cmd = [mpirun, "-np", str(np_), "--bind-to", "none"] + worker
    else:
        env["BENCH_PORT"] = str(free_port())
        cmd = launcher_command(np_, *(["--bind", bind] if impl == "fastxfer" and bind != "none" else [])) + worker
    if impl == "deepspeed":
        # one OpenMP thread per rank, as fastxfer's engine runs one thread per rank: with N ranks
        # on N cores more threads only oversubscribe (DeepSpeed's kernels are `omp parallel for`)
        env.setdefault("OMP_NUM_THREADS", "1")
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    finally:
        if impl == "deepspeed":
            remove_deepspeed_segments(env["BENCH_PORT"], np_)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return [], f"failed (exit {r.returncode}): {' | '.join(tail)}", {}
    per_rank = read_results(out, np_)
    if len(per_rank) != np_:
        return [], f"only {len(per_rank)} of {np_} ranks wrote results", {}
    skips = sorted({p["skip"] for p in per_rank if "skip" in p})
    if skips:
        return [], "; ".join(skips), {}
    rows = []
    for i, row in enumerate(per_rank[0]["results"]):
        row = dict(row)
        row["wrong"] = sum(p["results"][i]["wrong"] for p in per_rank)
        row["ranks"] = np_
        if impl in HYDRA:  # the mpi4py worker on another MPI: its rows carry that MPI's name
            row["impl"] = row["impl"].replace("mpi4py", HYDRA[impl][0], 1)
        rows.append(row)
    if impl == "fastxfer":
        rows[0]["engine_stats"] = per_rank[0]["stats"]
    return rows, None, per_rank[0].get("row_skips", {})


def remove_deepspeed_segments(port, np_: int) -> list[str]:
    """Unlinks the /dev/shm segments a DeepSpeed job on `port` left behind (it never unlinks its
    own); returns the paths removed."""
    removed = []
    for path in deepspeed_segments(port, np_):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


PEERS = ("fastxfer", "gloo", "mpi4py", "horovod", "deepspeed", "intel-mpi", "mpich")

# MPIs with hydra's mpiexec, run with the mpi4py worker (mpi4py loads them through MPI4PY_LIBMPI):
# name -> (row label, environment). Intel MPI spins in its waits by default, which starves ranks
# that share cores; its wait mode is what such a machine needs, and is its faster setting here.
HYDRA = {"intel-mpi": ("Intel MPI (I_MPI_WAIT_MODE=1)", {"I_MPI_WAIT_MODE": "1", "I_MPI_FABRICS": "shm"}),
         "mpich": ("MPICH", {})}


def hydra_prefix(impl: str) -> str | None:
    """Where Intel MPI's or MPICH's wheel is installed: FASTXFER_BENCH_IMPI / FASTXFER_BENCH_MPICH
    (a prefix with bin/mpiexec and lib/libmpi.so.12), else /opt/fastxfer-ci/{impi,mpich} (where
    .ci/launchers.sh puts them: `pip install --prefix DIR impi-rt` or `mpich`)."""
    key, folder = {"intel-mpi": ("FASTXFER_BENCH_IMPI", "impi"), "mpich": ("FASTXFER_BENCH_MPICH", "mpich")}[impl]
    for prefix in (os.environ.get(key), f"/opt/fastxfer-ci/{folder}"):
        if prefix and os.path.exists(os.path.join(prefix, "bin", "mpiexec")) and \
                os.path.exists(os.path.join(prefix, "lib", "libmpi.so.12")):
            return prefix
    return None


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _missing(impl: str) -> str | None:
    """Why `impl` cannot run here (None when it can)."""
    if impl not in PEERS:
        return f"unknown peer (expected one of {', '.join(PEERS)})"
    if impl == "gloo" and not _installed("torch"):
        return "not installed (pip install torch)"
    if impl in ("mpi4py", "horovod") and not _installed(impl):
        return "not installed"
    if impl in HYDRA:
        if not _installed("mpi4py"):
            return "mpi4py not installed"
        if hydra_prefix(impl) is None:
            name = "impi-rt" if impl == "intel-mpi" else "mpich"
            return (f"not found: pip install --prefix DIR {name} and set "
                    f"{'FASTXFER_BENCH_IMPI' if impl == 'intel-mpi' else 'FASTXFER_BENCH_MPICH'}=DIR")
    if impl == "deepspeed":
        if not _installed("deepspeed"):
            return "not installed (pip install deepspeed; it needs torch, a C++ compiler and ninja)"
        if not _installed("torch"):
            return "deepspeed is installed but torch is not"
    return None


# busbw / algbw per collective (nccl-tests' conventions, bytes = each rank's input)
def _bus_factor(collective: str, n: int) -> float:
    return {"allreduce": 2 * (n - 1) / n, "allgather": float(n - 1)}.get(collective, (n - 1) / n)


def peer_order(peers: tuple[str, ...], rep: int) -> tuple[str, ...]:
    """The order the peers run in on repeat `rep` (0-based): as given, then reversed, and so on, so
    that no peer always runs first on a machine that warms up or always last on one that tires."""
    return peers if rep % 2 == 0 else tuple(reversed(peers))


def run(np_: int = 2, b: int = 1 << 10, e: int = 64 << 20, f: int = 4, scale: float = 1.0,
        peers: tuple[str, ...] = PEERS, bind: str = "none", collectives: tuple[str, ...] = COLLECTIVES,
        repeat: int = 1) -> dict:
    """Every peer's sweep, `repeat` times with the order alternating (`peer_order`); each row is the
    median over the repeats of each run's p50 (`p50s` keeps them all, in run order). A peer that
    fails in one repeat is named in `skipped` with that repeat, and its other runs still count."""
    sizes = _sizes(b, e, f)
    skipped: dict[str, str] = {}
    runnable = []
    for impl in peers:
        why = _missing(impl)
        if why:
            skipped[impl] = why
        else:
            runnable.append(impl)
    runs: dict[str, list[list[dict]]] = {impl: [] for impl in runnable}
    with tempfile.TemporaryDirectory(prefix="fastxfer-bench-") as tmp:
        for rep in range(repeat):
            of = f", run {rep + 1} of {repeat}" if repeat > 1 else ""
            for impl in peer_order(tuple(runnable), rep):
                if impl == "deepspeed" and rep == 0:
                    status("deepspeed: the first run JIT-builds its shm extension with ninja (a minute or two)")
                status(f"{impl}: {np_} ranks, {len(sizes)} sizes {sizes[0]}..{sizes[-1]} bytes{of}")
                got, err, left_out = _launch(impl, np_, sizes, scale, os.path.join(tmp, str(rep)), collectives, bind)
                if err:
                    skipped[impl] = err + of
                    status(f"{impl}: {err}{of}")
                # rows a peer left out while running its others (DeepSpeed's bf16 kernel without AVX-512BW)
                for label, why in left_out.items():
                    skipped[label] = why
                    if rep == 0:
                        status(f"{label}: {why}")
                if got:
                    runs[impl].append(got)
    rows: list[dict] = []
    for impl in runnable:  # the table keeps the order the peers were asked for
        rows.extend(median_rows(runs[impl]))
    for r in rows:
        r["algbw"] = r["bytes"] / r["p50"] / GB
        r["busbw"] = r["algbw"] * _bus_factor(r.get("collective", "allreduce"), np_)
    return {"machine": machine_info(), "ranks": np_, "repeat": repeat, "rows": rows, "skipped": skipped,
            "targets": _targets(rows, e), "model": cost_model(rows, np_), "adasum": adasum_vs_sum(rows)}


def adasum_vs_sum(rows) -> list[dict]:
    """op='adasum' against the plain float32 sum ("fastxfer none") at every size both ran: the
    medians and their ratio (Adasum gathers every rank's bucket and combines it in float64 on each
    rank, where the sum reduce-scatters: docs/algorithms.md, "Adasum")."""
    out = []
    for a in rows:
        if a["impl"] == "fastxfer adasum" and (s := _at(rows, "fastxfer none", a["bytes"])):
            out.append({"bytes": a["bytes"], "sum_s": s["p50"], "adasum_s": a["p50"], "ratio": a["p50"] / s["p50"],
                        "wrong": a["wrong"]})
    return out


def _at(rows, impl, nbytes):
    for r in rows:
        if r["impl"] == impl and r["bytes"] == nbytes:
            return r
    return None


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB" if nbytes >= 1 << 10 else f"{nbytes} B"


def _targets(rows, big) -> list[dict]:
    out = []
    at = _human(big)
    fx_none = _at(rows, "fastxfer none", big)
    for peer, need in (("torch gloo", 5.0), ("horovod", 4.0)):
        p = _at(rows, peer, big)
        if fx_none and p:
            ratio = fx_none["busbw"] / p["busbw"]
            out.append(target(f"fastxfer busbw >= {need:g}x {peer} at {at}", ratio, need, ratio >= need))
    fx_bf16 = _at(rows, "fastxfer bf16", big)
    if fx_none and fx_bf16:
        ratio = fx_none["p50"] / fx_bf16["p50"]
        out.append(target(f"bf16-compressed faster than uncompressed at {at} (speed-up)", ratio, 1.0,
                          ratio > 1.0))
    fresh = _at(rows, "fastxfer none fresh", big)
    if fx_none and fresh:
        ratio = fresh["busbw"] / fx_none["busbw"]
        out.append(target(f"fresh output busbw >= 0.9x out= busbw at {at}", ratio, 0.9, ratio >= 0.9))
    array16 = _at(rows, "fastxfer bf16 array", big)
    if fx_none and array16:
        # time per element: a bf16 array of the same bytes holds twice the elements
        ratio = (fx_none["p50"] / (big // 4)) / (array16["p50"] / (big // 2))
        out.append(target(f"bf16 array elements/s >= float32 elements/s at {at}", ratio, 1.0,
                          ratio >= 1.0))
    for peer in ("mpi4py Allreduce", "Intel MPI (I_MPI_WAIT_MODE=1) Allreduce", "MPICH Allreduce"):
        for mine in ("fastxfer none", "fastxfer none fresh"):
            pairs = [(r["bytes"], p["p50"] / r["p50"]) for r in rows
                     if r["impl"] == mine and (p := _at(rows, peer, r["bytes"]))]
            if pairs:
                nbytes, ratio = min(pairs, key=lambda t: t[1])
                out.append(target(f"{mine} at least as fast as {peer} at every size (worst: {_human(nbytes)})",
                                  ratio, 1.0, ratio >= 1.0))
    for mine, peer in (("fastxfer none fresh", "deepspeed fp32"), ("fastxfer bf16 array fresh", "deepspeed bf16")):
        pairs = [(r["bytes"], r["busbw"] / p["busbw"]) for r in rows
                 if r["impl"] == mine and r["bytes"] >= 64 << 10 and (p := _at(rows, peer, r["bytes"]))]
        if pairs:
            nbytes, ratio = min(pairs, key=lambda t: t[1])
            text = f"{mine} busbw >= {peer} at every size from 64 KiB (worst: {_human(nbytes)})"
            out.append(target(text, ratio, 1.0, ratio >= 1.0))
    return out


# ---- alpha-beta model -------------------------------------------------------------------------

def _fit(rows, impl, np_):
    """T(bytes) = a + b * bytes by least squares over the sweep (medians)."""
    pts = [(r["bytes"], r["p50"]) for r in rows if r["impl"] == impl]
    if len(pts) < 3:
        return None
    x = np.array([p[0] for p in pts], float)
    y = np.array([p[1] for p in pts], float)
    b, a = np.polyfit(x, y, 1)
    return max(a, 1e-7), max(b, 1e-13)


def cost_model(rows, np_) -> dict:
    """Predicts allreduce time of a 100 MB float32 gradient (ResNet-50 scale) on p ranks.

    Calibrated here: the intra-host stage (shared memory) from fastxfer's own sweep, a + b*bytes
    for `np_` local ranks; the per-message software latency of MPI from mpi4py's smallest size.
    Network: beta_net = 8 / link bits per second; alpha_net = measured MPI latency + 5 us wire.
      ring over p ranks:     2(p-1) alpha_net + 2(p-1)/p * S * beta_net
      hierarchical, k/host:  shm(S) + 2(h-1) alpha_net + 2(h-1)/h * S * beta_net,  h = p/k
        (each local rank carries S/k across hosts; the k shards share the host's link)
    bf16 halves S on the wire.
    """
    shm = _fit(rows, "fastxfer none", np_)
    shm16 = _fit(rows, "fastxfer bf16", np_)
    mpi_small = min((r["p50"] for r in rows if r["impl"] == "mpi4py Allreduce"), default=20e-6)
    if shm is None:
        return {}
    alpha_net = mpi_small / max(1, 2 * (np_ - 1)) + 5e-6
    size = 100e6
    k = np_
    table = []
    for gbps in (25, 100, 400):
        beta = 8 / (gbps * 1e9)
        for p in (8, 16, 32, 64, 128, 256, 512, 1024):
            h = max(1, p // k)
            ring = 2 * (p - 1) * alpha_net + 2 * (p - 1) / p * size * beta
            hier = shm[0] + shm[1] * size + 2 * (h - 1) * alpha_net + 2 * (h - 1) / h * size * beta
            s16 = shm16 or shm
            hier16 = s16[0] + s16[1] * size + 2 * (h - 1) * alpha_net + 2 * (h - 1) / h * size / 2 * beta
            table.append({"gbps": gbps, "ranks": p, "ring_s": ring, "hier_s": hier, "hier_bf16_s": hier16})
    return {"alpha_net_s": alpha_net, "shm_alpha_s": shm[0], "shm_beta_s_per_byte": shm[1],
            "ranks_per_host": k, "gradient_bytes": size, "table": table}


# ---- report -----------------------------------------------------------------------------------

COLUMNS = ["impl", "bytes", "p50 us", "algbw GB/s", "busbw GB/s", "#wrong"]


def report(res: dict, markdown: bool = False) -> None:
    m = res["machine"]
    repeat = res.get("repeat", 1)
    caption = (f"{m['date']} | {m['cpu']} | {m['cpus']} CPUs | {res['ranks']} ranks on this host | "
               f"GB = 1e9 B; busbw = algbw*2(n-1)/n; p50 over iterations"
               + (f", median of {repeat} runs (the peers' order alternating)" if repeat > 1 else ""))
    columns = COLUMNS + (["runs' p50 us"] if repeat > 1 else [])
    rows = [[r["impl"], str(r["bytes"]), f"{r['p50'] * 1e6:.1f}", f"{r['algbw']:.2f}", f"{r['busbw']:.2f}",
             str(r["wrong"])] + ([" / ".join(f"{p * 1e6:.1f}" for p in r["p50s"])] if repeat > 1 else [])
            for r in res["rows"]]
    print_table("fastxfer bench allreduce", columns, rows, caption)
    for k, v in res["skipped"].items():
        print(f"  skipped {k}: {v}")
    print_targets(res["targets"])
    acols = ["bytes", "sum p50 us", "adasum p50 us", "adasum / sum", "#wrong"]
    arows = [[_human(a["bytes"]), f"{a['sum_s'] * 1e6:.1f}", f"{a['adasum_s'] * 1e6:.1f}", f"{a['ratio']:.2f}x",
              str(a["wrong"])] for a in res.get("adasum", [])]
    if arows:
        print_table("Adasum vs sum (float32)", acols, arows, "time of op='adasum' over op='sum', same arrays")
    model = res.get("model") or {}
    mrows = []
    for t in model.get("table", []):
        mrows.append([f"{t['gbps']} Gb/s", str(t["ranks"]), f"{t['ring_s'] * 1e3:.1f}", f"{t['hier_s'] * 1e3:.1f}",
                      f"{t['hier_bf16_s'] * 1e3:.1f}"])
    mcols = ["network", "ranks", "ring ms", f"hierarchical ({model.get('ranks_per_host', '?')}/host) ms",
             "hierarchical + bf16 ms"]
    if mrows:
        print_table("alpha-beta model: 100 MB float32 allreduce", mcols, mrows,
                    f"alpha_net {model['alpha_net_s'] * 1e6:.1f} us, shm {model['shm_alpha_s'] * 1e6:.1f} us + "
                    f"{1 / model['shm_beta_s_per_byte'] / GB:.2f} GB/s (calibrated on this host)")
    if markdown:
        print_markdown(m, caption, columns, rows, res["targets"])
        if arows:
            print()
            print(markdown_table(acols, arows))
        for k, v in res["skipped"].items():
            print(f"- skipped {k}: {v}")
        if mrows:
            print()
            print(markdown_table(mcols, mrows))


def plot(res: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for impl in dict.fromkeys(r["impl"] for r in res["rows"]):
        sel = [r for r in res["rows"] if r["impl"] == impl]
        a1.plot([r["bytes"] for r in sel], [r["busbw"] for r in sel], marker="o", label=impl)
    a1.set_xscale("log", base=2)
    a1.set_xlabel("message size (bytes)")
    a1.set_ylabel("busbw (GB/s)")
    a1.set_title(f"allreduce, {res['ranks']} ranks on one host")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    model = res.get("model") or {}
    for gbps, color in ((25, "tab:red"), (100, "tab:blue"), (400, "tab:green")):
        sel = [t for t in model.get("table", []) if t["gbps"] == gbps]
        if not sel:
            continue
        ps = [t["ranks"] for t in sel]
        a2.plot(ps, [t["ring_s"] * 1e3 for t in sel], color=color, linestyle="--", label=f"ring {gbps} Gb/s")
        a2.plot(ps, [t["hier_s"] * 1e3 for t in sel], color=color, label=f"hierarchical {gbps} Gb/s")
        a2.plot(ps, [t["hier_bf16_s"] * 1e3 for t in sel], color=color, linestyle=":", label=f"hier.+bf16 {gbps} Gb/s")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("ranks")
    a2.set_ylabel("predicted time for 100 MB (ms)")
    a2.set_title("alpha-beta model (calibrated here)")
    a2.legend(fontsize=7)
    a2.grid(alpha=0.3)
    m = res["machine"]
    fig.suptitle(f"fastxfer bench allreduce - {m['cpu']}, {m['date']}", fontsize=9)
    save_plot(fig, path)


def _parse_size(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-np", "--np", dest="np", type=int, default=2, help="ranks on this host (default 2)")
    p.add_argument("-b", "--minbytes", default="1K", help="smallest message (default 1K)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest message (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier between steps (default 4)")
    p.add_argument("--iters-scale", type=float, default=1.0, help="scale the iteration counts")
    p.add_argument("--peers", default=",".join(PEERS), help=f"implementations to run (default {','.join(PEERS)})")
    p.add_argument("--collectives", default=",".join(COLLECTIVES),
                   help=f"collectives to measure (default {','.join(COLLECTIVES)})")
    p.add_argument("--bind", choices=["none", "socket", "numa"], default="none",
                   help="start the fastxfer ranks with `fastxfer run --bind` (DeepSpeed's ranks are always pinned "
                        "one per core, its best setting; --bind numa gives fastxfer the same); default none")
    p.add_argument("--hosts", metavar="HxK[,HxK...]",
                   help="across simulated hosts instead (root): H hosts of K ranks each, e.g. 2x2 or 2x1,2x2,3x1; "
                        "fastxfer vs mpi4py Allreduce, bytes on the links, and the cost model checked "
                        "(fastxfer.bench.hosts; sizes default 1M..64M)")
    p.add_argument("--rates", default="none",
                   help="with --hosts: link rates to run at, tc token-bucket syntax, e.g. none,2gbit,500mbit")
    p.add_argument("--mpi-configs", default="all",
                   help="with --hosts: the Open MPI configurations to run, comma-separated (han, no-han, han-simple, "
                        "han/node, no-han/node) or all (default); fastxfer is compared with the best of them")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every peer's sweep (with --hosts: every launch) this many times, the peers' order "
                        "alternating between repeats, and report the medians (default 1)")
    p.add_argument("--json", metavar="PATH", help="write results as JSON (- for stdout)")
    p.add_argument("--plot", metavar="PNG", help="busbw vs size, and the cost model")
    p.add_argument("--markdown", action="store_true", help="also print markdown tables (for bench/RESULTS.md)")


def _main_hosts(args: argparse.Namespace) -> int:
    from fastxfer.bench import hosts

    try:
        configs = hosts.parse_configs(args.hosts)
        rates = [r.strip() for r in args.rates.split(",") if r.strip()] or ["none"]
        for r in rates:
            hosts.parse_rate(r)
        mpi_configs = hosts.parse_mpi_configs(args.mpi_configs)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    lo = _parse_size(args.minbytes) if args.minbytes != "1K" else 1 << 20
    sizes = _sizes(lo, _parse_size(args.maxbytes), args.stepfactor)
    peers = tuple(p.strip() for p in args.peers.split(",") if p.strip() in ("fastxfer", "mpi4py"))
    res = hosts.run(configs, rates, sizes, args.iters_scale, peers or ("fastxfer", "mpi4py"), max(1, args.repeat),
                    mpi_configs)
    if args.json:
        write_json(args.json, res)
    if args.json != "-":
        hosts.report(res, args.markdown)
    if args.plot:
        hosts.plot(res, args.plot)
    if "hosts" in res["skipped"]:
        print(f"fastxfer bench allreduce --hosts: {res['skipped']['hosts']}", file=sys.stderr)
        return 2
    wrong = sum(r["wrong"] for r in res["rows"])
    if wrong or not any(r["impl"].startswith("fastxfer") for r in res["rows"]):
        print(f"fastxfer: {wrong} wrong elements" if wrong else "fastxfer did not run", file=sys.stderr)
        return 1
    return 0


def main(args: argparse.Namespace) -> int:
    if getattr(args, "hosts", None):
        return _main_hosts(args)
    if args.np < 1 or args.stepfactor < 2:
        raise SystemExit("-np must be >= 1 and -f >= 2")
    bad = [c for c in args.collectives.split(",") if c.strip() and c.strip() not in COLLECTIVES]
    if bad:
        raise SystemExit(f"unknown collective(s) {', '.join(bad)}: expected some of {', '.join(COLLECTIVES)}")
    res = run(args.np, _parse_size(args.minbytes), _parse_size(args.maxbytes), args.stepfactor, args.iters_scale,
              tuple(p.strip() for p in args.peers.split(",") if p.strip()), args.bind,
              tuple(c.strip() for c in args.collectives.split(",") if c.strip()), max(1, args.repeat))
    if args.json:
        write_json(args.json, res)
    if args.json != "-":
        report(res, args.markdown)
    if args.plot:
        plot(res, args.plot)
    wrong = sum(r["wrong"] for r in res["rows"] if r["impl"].startswith("fastxfer"))
    ran_fastxfer = any(r["impl"].startswith("fastxfer") for r in res["rows"])
    if wrong or not ran_fastxfer:
        print(f"fastxfer: {wrong} wrong elements" if ran_fastxfer else "fastxfer did not run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.allreduce", description=__doc__)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
