"""``fastxfer bench allreduce --hosts 2x2[,3x1,...]``: the allreduce across simulated hosts
(fastxfer.bench.simhosts: own network, host name and /dev/shm each, joined by veth links over TCP),
fastxfer side by side with mpi4py ``Allreduce`` (Open MPI with its shared-memory and TCP
transports) on the same hosts, launched the same way (``fastxfer run --hosts``, which also picks
Open MPI's yielding mode when the ranks outnumber the cores: both get it).

Rows per configuration (``HxK``: H hosts, K ranks on each) and link rate:

- ``fastxfer none`` / ``fastxfer bf16``: float32 arrays, uncompressed / bf16 on the wire;
- ``fastxfer none, overlap off``: the same with ``FASTXFER_NET_CHUNK_MB=0`` (by default each
  chunk's network stage runs on a thread of its own, overlapped with the shared-memory stages of
  the next; 0 turns that off), so both are measured;
- ``fastxfer none, mpi4py link``: the same with ``FASTXFER_NATIVE_MPI=0`` (the network stage
  through mpi4py, holding the GIL, as before the native transport: csrc/transport/mpi_native.h);
- ``mpi4py Allreduce`` and ``mpi4py Allreduce (<config>)``: float32, Open MPI in every
  configuration a user could pick (``--mpi-configs``; MPI_CONFIGS: the mapping, the ``han``
  hierarchical component on, off or with its simple allreduce), because which one wins depends on
  the link. Each fastxfer row is compared with the best of them at its size and link (``vs best
  MPI``, naming the configuration), and a rate-limited row with the link's limit: the time the
  bytes each host must send take at that rate (``of link``).

Every row also counts what the first host put on its link per call (``wire_bytes``, from the
namespace's /proc/self/net/dev), to check against docs/algorithms.md's ``2(h-1)/h * S`` per host.
``--rates none,1gbit`` repeats every configuration with a ``tc`` token bucket on every host's link.

The cost model, checked: one host's sweep with K ranks gives the shared-memory stage ``T_shm,K(S)``;
the network's alpha and beta are fitted to the first configuration (``T - T_shm`` against the bytes
per host), then every configuration (and rate) is predicted as
``T_shm,K(S) + 2(h-1) alpha + 2(h-1)/h * S_wire * beta * max(1, h/cores)`` -- the last factor because
simulated hosts share this machine's cores and TCP is CPU work; on a rate-limited link the byte
cost is the larger of that and the link's -- and set beside its measurement.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import numpy as np

from fastxfer.bench.harness import (GB, free_port, launcher_command, machine_info, median_rows, read_results, status,
                                    target, worker_command)

ROWS_FX = ("fastxfer none", "fastxfer bf16")
OVERLAP = {"1": "fastxfer none, overlap on", "0": "fastxfer none, overlap off"}
PY_LINK = "fastxfer none, mpi4py link"
MPI_ROW = "mpi4py Allreduce"
# Open MPI's configurations a user could pick (mpirun arguments): the default mapping fills a host
# before the next (by slot), by node deals ranks round-robin; `han` (the hierarchical component)
# as it comes, off, or with its simple allreduce. The first is what `fastxfer run --hosts` gives.
MPI_CONFIGS = {
    "han": (),
    "no-han": ("--mca", "coll", "^han"),
    "han-simple": ("--mca", "coll_han_use_simple_allreduce", "1"),
    "han/node": ("--map-by", "node"),
    "no-han/node": ("--map-by", "node", "--mca", "coll", "^han"),
}


def mpi_row(config: str) -> str:
    return MPI_ROW if config == "han" else f"{MPI_ROW} ({config})"


def parse_mpi_configs(text: str | None) -> list[str]:
    """--mpi-configs: "all" (default) or names from MPI_CONFIGS, comma-separated."""
    if not text or text == "all":
        return list(MPI_CONFIGS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in MPI_CONFIGS]
    if bad or not names:
        raise ValueError(f"--mpi-configs: unknown {', '.join(bad) or 'nothing'}; choose from all, "
                         f"{', '.join(MPI_CONFIGS)}")
    return names


def link_limit_s(hosts: int, nbytes: float, rate_bits: float | None) -> float | None:
    """The least time an allreduce of `nbytes` (on the wire) can take on links of `rate_bits`: what
    each host must send, 2(h-1)/h * S, at that rate."""
    return wire_formula(hosts, nbytes) * 8 / rate_bits if rate_bits else None


def parse_configs(text: str) -> list[tuple[int, int]]:
    """"2x2,3x1" -> [(2, 2), (3, 1)]: hosts x ranks per host."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", part)
        if not m or int(m.group(1)) < 2 or int(m.group(2)) < 1:
            raise ValueError(f"--hosts wants HOSTSxRANKS with at least 2 hosts and 1 rank each (e.g. 2x2,3x1), "
                             f"not {part.strip()!r}")
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def parse_rate(text: str) -> float | None:
    """A tc rate ("500mbit", "2gbit", "none") in bits per second; None for an unlimited link."""
    t = text.strip().lower()
    if t in ("none", "", "0"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", t)
    if not m:
        raise ValueError(f"--rates wants tc rates such as 500mbit or 2gbit (or none), not {text!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def wire_formula(hosts: int, nbytes: float) -> float:
    """Bytes one host sends per allreduce of `nbytes` on the wire (docs/algorithms.md)."""
    return 2 * (hosts - 1) / hosts * nbytes


def _launch_on(sim, slots: int, impl: str, only: tuple[str, ...], sizes: list[int], scale: float, tmp: str,
               env_extra: dict | None = None, mpi_args: tuple = ()) -> tuple[list[dict], str | None]:
    out = os.path.join(tmp, f"{impl}-{len(os.listdir(tmp))}")
    worker = worker_command("allreduce_worker", "--impl", impl, "--sizes", ",".join(map(str, sizes)),
                            "--iters-scale", str(scale), "--out", out, "--collectives", "allreduce",
                            "--only", ",".join(only), "--wire")
    env = dict(os.environ, **(env_extra or {}))
    env.pop("FASTXFER_HOST_ID", None)
    extra = ("--mpi-args", " ".join(mpi_args)) if mpi_args else ()
    r = subprocess.run(sim.fastxfer_run(slots, worker, extra=extra), env=env, capture_output=True, text=True,
                       timeout=3600)
    np_ = slots * sim.n
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return [], f"failed (exit {r.returncode}): {' | '.join(tail)}"
    per_rank = read_results(out, np_)
    if len(per_rank) != np_:
        return [], f"only {len(per_rank)} of {np_} ranks wrote results"
    rows = []
    for i, row in enumerate(per_rank[0]["results"]):
        row = dict(row)
        row["wrong"] = sum(p["results"][i]["wrong"] for p in per_rank)
        rows.append(row)
    return rows, None


def _one_host_sweeps(slots: set[int], sizes: list[int], scale: float, tmp: str,
                     repeat: int = 1) -> dict[int, list[dict]]:
    """fastxfer's own sweep on this host with K ranks: the shared-memory stage of the model."""
    out = {}
    for k in sorted(slots):
        runs = []
        for rep in range(repeat):
            status(f"one host, {k} rank(s): the shared-memory stage" + (f", run {rep + 1} of {repeat}"
                                                                         if repeat > 1 else ""))
            path = os.path.join(tmp, f"one-host-{k}-{rep}")
            worker = worker_command("allreduce_worker", "--impl", "fastxfer", "--sizes", ",".join(map(str, sizes)),
                                    "--iters-scale", str(scale), "--out", path, "--collectives", "allreduce",
                                    "--only", ",".join(ROWS_FX))
            env = dict(os.environ, BENCH_PORT=str(free_port()))
            r = subprocess.run(launcher_command(k) + worker, env=env, capture_output=True, text=True, timeout=3600)
            per_rank = read_results(path, k)
            if r.returncode != 0 or len(per_rank) != k:
                tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
                raise RuntimeError(f"one-host sweep with {k} ranks failed (exit {r.returncode}): {tail}")
            runs.append(per_rank[0]["results"])
        out[k] = median_rows(runs)
    return out


def _interp(rows: list[dict], impl: str, nbytes: int) -> float | None:
    for r in rows:
        if r["impl"] == impl and r["bytes"] == nbytes:
            return r["p50"]
    return None


def run(configs: list[tuple[int, int]], rates: list[str], sizes: list[int], scale: float = 1.0,
        peers: tuple[str, ...] = ("fastxfer", "mpi4py"), repeat: int = 1,
        mpi_configs: list[str] | None = None) -> dict:
    """`repeat`: every launch that many times, alternating the peers (the machine is shared and
    noisy); rows carry the median of the repeats' p50s. `mpi_configs`: the Open MPI
    configurations to run (MPI_CONFIGS names; default all)."""
    from fastxfer.comm.group import net_chunk_bytes
    from fastxfer.bench.simhosts import SimHosts

    mpi_configs = list(mpi_configs or MPI_CONFIGS)
    res = {"machine": machine_info(), "configs": configs, "rates": rates, "rows": [], "skipped": {},
           "repeat": repeat, "mpi_configs": mpi_configs}
    why = SimHosts.available()
    if why:
        res["skipped"]["hosts"] = why
        return res
    with tempfile.TemporaryDirectory(prefix="fastxfer-bench-hosts-") as tmp:
        shm = _one_host_sweeps({k for _, k in configs}, sizes, scale, tmp, repeat)
        res["one_host"] = {str(k): v for k, v in shm.items()}
        for hosts, slots in configs:
            with SimHosts(hosts) as sim:
                for rate_text in rates:
                    bits = parse_rate(rate_text)
                    label = f"{hosts}x{slots}" + (f" @ {rate_text}" if bits else "")
                    if bits:
                        try:
                            sim.limit_rate(rate_text, bits)
                        except RuntimeError as e:
                            res["skipped"][label] = str(e)
                            status(f"{label}: {e}")
                            continue
                    # (label, worker impl, rows it reports, environment, mpirun arguments)
                    runs = []
                    if "fastxfer" in peers:
                        runs.append(("fastxfer none", "fastxfer", ROWS_FX, {}, ()))
                        # the other overlap setting than the default (FASTXFER_NET_CHUNK_MB, if the user set it)
                        other = "0" if net_chunk_bytes() else "1"
                        runs.append((OVERLAP[other], "fastxfer", ("fastxfer none",),
                                     {"FASTXFER_NET_CHUNK_MB": other}, ()))
                        runs.append((PY_LINK, "fastxfer", ("fastxfer none",), {"FASTXFER_NATIVE_MPI": "0"}, ()))
                    if "mpi4py" in peers:
                        for name in mpi_configs:
                            runs.append((mpi_row(name), "mpi4py", (MPI_ROW,), {}, MPI_CONFIGS[name]))
                    got_all: dict[int, list[list[dict]]] = {i: [] for i in range(len(runs))}
                    for rep in range(repeat):
                        for i, (name, impl, only, env, args) in enumerate(runs):
                            status(f"{label}: {name}, sizes {sizes[0]}..{sizes[-1]} bytes"
                                   + (f", run {rep + 1} of {repeat}" if repeat > 1 else ""))
                            got, err = _launch_on(sim, slots, impl, only, sizes, scale, tmp, env, args)
                            if err:
                                res["skipped"][f"{label} {name}"] = err
                                status(f"{label} {name}: {err}")
                            elif got:
                                got_all[i].append(got)
                    for i, (name, impl, only, env, args) in enumerate(runs):
                        for r in median_rows(got_all[i]):
                            if env or args:
                                r["impl"] = name
                            r.update(hosts=hosts, slots=slots, rate=rate_text if bits else "none", rate_bits=bits,
                                     algbw=r["bytes"] / r["p50"] / GB)
                            res["rows"].append(r)
                    if bits:
                        sim.unlimit()
    res["targets"] = targets(res, sizes)
    res["model"] = fit_model(res)
    return res


def _row(res, hosts, slots, rate, impl, nbytes):
    for r in res["rows"]:
        if (r["hosts"], r["slots"], r["rate"], r["impl"], r["bytes"]) == (hosts, slots, rate, impl, nbytes):
            return r
    return None


def best_mpi(res: dict, hosts: int, slots: int, rate: str, nbytes: int) -> dict | None:
    """The fastest Open MPI configuration's row at this size and link (None when none ran)."""
    rows = [r for r in res["rows"] if (r["hosts"], r["slots"], r["rate"], r["bytes"]) == (hosts, slots, rate, nbytes)
            and r["impl"].startswith(MPI_ROW) and r["wrong"] == 0]
    return min(rows, key=lambda r: r["p50"]) if rows else None


def targets(res: dict, sizes: list[int]) -> list[dict]:
    """Issue 33's: float32 at least as fast as the best MPI configuration at every size and link
    (1.2x at 16 MiB on an unlimited link), and 0.9 of the link's limit at 16 MiB and above on a
    limited one (bf16 too, against its own, half-size limit)."""
    out = []
    for hosts, slots in res["configs"]:
        for rate in dict.fromkeys(r["rate"] for r in res["rows"]):
            where = f"{hosts}x{slots}" + ("" if rate == "none" else f" @ {rate}")
            for s in sizes:
                f = _row(res, hosts, slots, rate, "fastxfer none", s)
                m = best_mpi(res, hosts, slots, rate, s)
                if f and m:
                    need = 1.2 if rate == "none" and s >= 16 << 20 else 1.0
                    ratio = m["p50"] / f["p50"]
                    out.append(target(f"{where}, {_size(s)}: fastxfer none >= {need:g}x the best Open MPI "
                                      f"({m['impl']})", ratio, need, ratio >= need))
                for impl, wire in (("fastxfer none", s), ("fastxfer bf16", s / 2)):
                    row = _row(res, hosts, slots, rate, impl, s)
                    limit = link_limit_s(hosts, wire, row["rate_bits"]) if row else None
                    if limit and s >= 16 << 20:
                        frac = limit / row["p50"]
                        out.append(target(f"{where}, {_size(s)}: {impl} >= 0.9 of the link's limit", frac, 0.9,
                                          frac >= 0.9))
            big = [s for s in sizes if s >= 16 << 20]
            if big:
                s = big[-1]
                f, b = (_row(res, hosts, slots, rate, i, s) for i in ("fastxfer none", "fastxfer bf16"))
                if f and b and f.get("wire_bytes") and b.get("wire_bytes"):
                    half = b["wire_bytes"] / f["wire_bytes"]
                    out.append(target(f"{where}: bf16 wire bytes / float32 wire bytes at {s >> 20} MiB (<= 0.55)",
                                      half, 0.55, half <= 0.55))
                if f and f.get("wire_bytes"):
                    ratio = f["wire_bytes"] / wire_formula(hosts, s)
                    out.append(target(f"{where}: float32 wire bytes / docs formula 2(h-1)/h*S at {s >> 20} MiB "
                                      f"(TCP/IP headers: 1.0-1.1)", ratio, 1.1, 1.0 <= ratio <= 1.1))
    return out


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _shm_fit(res: dict, slots: int, impl: str):
    rows = [r for r in res.get("one_host", {}).get(str(slots), []) if r["impl"] == impl]
    if len(rows) < 2:
        return None
    b, a = np.polyfit([r["bytes"] for r in rows], [r["p50"] for r in rows], 1)
    return float(a), float(b)


def fit_model(res: dict) -> dict:
    """alpha/beta of the network fitted to the first configuration at the unlimited rate, then
    every configuration predicted beside its measurement (see the module docstring)."""
    if not res["rows"] or not res["configs"]:
        return {}
    h0, k0 = res["configs"][0]
    shm0 = _shm_fit(res, k0, "fastxfer none")
    cal = [r for r in res["rows"] if (r["hosts"], r["slots"], r["rate"], r["impl"]) == (h0, k0, "none",
                                                                                         "fastxfer none")]
    if shm0 is None or len(cal) < 2:
        return {}
    cores = max(1, len(os.sched_getaffinity(0)))

    def shared(h: int) -> float:
        # Simulated hosts share this machine's cores, and moving bytes over TCP is CPU work: with
        # more hosts than cores each gets cores/h of the machine. On real hosts this is 1.
        return max(1.0, h / cores)

    x = np.array([wire_formula(h0, r["bytes"]) * shared(h0) for r in cal])
    y = np.array([r["p50"] - (shm0[0] + shm0[1] * r["bytes"]) for r in cal])
    beta, c = np.polyfit(x, y, 1)
    alpha = max(float(c) / (2 * (h0 - 1)), 0.0)
    beta = max(float(beta), 1e-13)
    table = []
    for r in res["rows"]:
        if r["impl"] not in ROWS_FX:
            continue
        wire_dtype_bytes = 2 if r["impl"] == "fastxfer bf16" else 4
        shm = _shm_fit(res, r["slots"], r["impl"])
        if shm is None:
            continue
        h = r["hosts"]
        s_wire = r["bytes"] * wire_dtype_bytes / 4
        # a rate-limited link: the slower of the machine's own cost per byte and the link's
        b_host = beta * shared(h)
        b_link = max(b_host, 8 / r["rate_bits"]) if r["rate_bits"] else b_host
        pred = shm[0] + shm[1] * r["bytes"] + 2 * (h - 1) * alpha + wire_formula(h, s_wire) * b_link
        table.append({"config": f"{h}x{r['slots']}", "rate": r["rate"], "impl": r["impl"], "bytes": r["bytes"],
                      "predicted_s": pred, "measured_s": r["p50"], "error": pred / r["p50"] - 1,
                      "calibration": (h, r["slots"], r["rate"]) == (h0, k0, "none") and r["impl"] == "fastxfer none"})
    errs = [abs(t["error"]) for t in table if not t["calibration"] and t["bytes"] >= 1 << 20]
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "calibrated_on": f"{h0}x{k0}", "cores": cores,
            "median_abs_error": float(np.median(errs)) if errs else None,
            "max_abs_error": float(max(errs)) if errs else None, "table": table}


# ---- report ---------------------------------------------------------------------------------------

COLUMNS = ["hosts", "link", "impl", "bytes", "p50 ms", "algbw GB/s", "vs best MPI", "best MPI", "of link",
           "wire MB/host", "#wrong"]


def table_rows(res: dict) -> list[list[str]]:
    rows = []
    for r in res["rows"]:
        m = best_mpi(res, r["hosts"], r["slots"], r["rate"], r["bytes"])
        mine = r["impl"].startswith(MPI_ROW)
        vs = f"{m['p50'] / r['p50']:.2f}x" if m else ""
        best = (m["impl"].replace(MPI_ROW, "").strip(" ()") or "han") if m else ""
        wire_dtype = 2 if "bf16" in r["impl"] else 4
        limit = link_limit_s(r["hosts"], r["bytes"] * wire_dtype / 4, r.get("rate_bits"))
        of_link = f"{limit / r['p50']:.2f}" if limit else ""
        wire = f"{r['wire_bytes'] / 1e6:.2f}" if r.get("wire_bytes") is not None else ""
        rows.append([f"{r['hosts']}x{r['slots']}", r["rate"], r["impl"], str(r["bytes"]), f"{r['p50'] * 1e3:.3f}",
                     f"{r['algbw']:.2f}", vs, best if not mine else "", of_link, wire, str(r["wrong"])])
    return rows


MODEL_COLUMNS = ["hosts", "link", "impl", "bytes", "predicted ms", "measured ms", "error"]


def model_rows(model: dict) -> list[list[str]]:
    return [[t["config"], t["rate"], t["impl"] + (" (fit)" if t["calibration"] else ""), str(t["bytes"]),
             f"{t['predicted_s'] * 1e3:.2f}", f"{t['measured_s'] * 1e3:.2f}", f"{t['error'] * 100:+.0f}%"]
            for t in model.get("table", [])]


def report(res: dict, markdown: bool = False) -> None:
    from fastxfer.bench.harness import markdown_table, print_markdown, print_table, print_targets

    m = res["machine"]
    caption = (f"{m['date']} | {m['cpu']} | {m['cpus']} CPUs | simulated hosts (veth, TCP) | HxK = H hosts x K ranks "
               f"| p50 over iterations, median of {res.get('repeat', 1)} run(s) | wire = bytes the first host sent "
               f"per call")
    rows = table_rows(res)
    print_table("fastxfer bench allreduce --hosts", COLUMNS, rows, caption)
    for k, v in res["skipped"].items():
        print(f"  skipped {k}: {v}")
    print_targets(res.get("targets", []))
    model = res.get("model") or {}
    mrows = model_rows(model)
    mcap = ""
    if mrows:
        mcap = (f"alpha {model['alpha_s'] * 1e6:.0f} us, beta {1 / model['beta_s_per_byte'] / GB:.2f} GB/s, fitted on "
                f"{model['calibrated_on']}; error of the predictions from 1 MiB up: median "
                f"{(model['median_abs_error'] or 0) * 100:.0f}%, worst {(model['max_abs_error'] or 0) * 100:.0f}%")
        print_table("cost model: predicted vs measured", MODEL_COLUMNS, mrows, mcap)
    if markdown:
        print_markdown(m, caption, COLUMNS, rows, res.get("targets"))
        for k, v in res["skipped"].items():
            print(f"- skipped {k}: {v}")
        if mrows:
            print(f"\n{mcap}\n")
            print(markdown_table(MODEL_COLUMNS, mrows))


def plot(res: dict, path: str) -> None:
    from fastxfer.bench.harness import pyplot, save_plot

    plt = pyplot()
    if plt is None or not res["rows"]:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for key in dict.fromkeys((r["hosts"], r["slots"], r["rate"], r["impl"]) for r in res["rows"]):
        sel = [r for r in res["rows"] if (r["hosts"], r["slots"], r["rate"], r["impl"]) == key]
        a1.plot([r["bytes"] for r in sel], [r["p50"] * 1e3 for r in sel], marker="o",
                label=f"{key[0]}x{key[1]} {key[2]}: {key[3]}")
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("message size (bytes)")
    a1.set_ylabel("time per allreduce (ms)")
    a1.set_title("allreduce across simulated hosts")
    a1.legend(fontsize=6)
    a1.grid(alpha=0.3)
    table = (res.get("model") or {}).get("table", [])
    if table:
        xs = [t["measured_s"] * 1e3 for t in table]
        ys = [t["predicted_s"] * 1e3 for t in table]
        a2.scatter(xs, ys, c=["tab:red" if t["calibration"] else "tab:blue" for t in table], s=14)
        lim = [min(xs + ys) * 0.8, max(xs + ys) * 1.2]
        a2.plot(lim, lim, color="gray", linewidth=0.8)
        a2.set_xscale("log")
        a2.set_yscale("log")
        a2.set_xlabel("measured (ms)")
        a2.set_ylabel("predicted (ms)")
        a2.set_title("cost model (red: the fit's own points)")
        a2.grid(alpha=0.3)
    m = res["machine"]
    fig.suptitle(f"fastxfer bench allreduce --hosts - {m['cpu']}, {m['date']}", fontsize=9)
    save_plot(fig, path)
