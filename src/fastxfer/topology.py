"""Machine topology and worker placement: the Intel recipe (one worker per socket bound with
numactl, OMP/KMP/TF thread settings, intra-op threads = cores - reserved cores for the
engine, bf16 where the hardware has it), worked out for any machine.

The probe and the plan are C++ (csrc/topology); this module formats them and applies them.
"""

from __future__ import annotations

import sys

from fastxfer import _core, settings
from fastxfer.errors import TopologyError

DESIGN_KEYS = ("sockets", "cores", "threads_per_core", "numa_nodes", "isa", "workers")


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the sysfs cpulist form; sorted, no repeats).

    The native parser is the one sysfs files go through too, so every CPU list fastxfer reads
    (sysfs, --cpus, FASTXFER_ENGINE_CPUS) follows the same grammar."""
    try:
        return list(_core.parse_cpu_list(text))
    except TopologyError:
        raise TopologyError(f"bad CPU list {text!r}: expected items like 3 or 0-7, joined with ','") from None


def format_cpu_list(cpus) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8': the canonical sysfs form of any iterable of CPU numbers."""
    return _core.format_cpu_list(sorted(set(cpus)))


ISA_KEYS = ("avx2", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _topology_dict(t) -> dict:
    """The native Topology as plain data (what `fastxfer topo --json` prints)."""
    cpus = [{k: getattr(c, k) for k in ("cpu", "socket", "core", "node", "online", "allowed")} for c in t.cpus]
    return {
        "sockets": t.sockets,
        "cores": t.cores,
        "threads_per_core": t.threads_per_core,
        "cpus": cpus,
        "numa_nodes": [{"id": n.id, "cpus": format_cpu_list(n.cpus), "memory_mb": n.memory_mb} for n in t.nodes],
        "caches": [{"level": c.level, "type": c.type, "size_kb": c.size_kb} for c in t.caches],
        "isa": {k: getattr(t.isa, k) for k in ISA_KEYS},
        "notes": list(t.notes),
        "online": format_cpu_list(c["cpu"] for c in cpus if c["online"]),
        "offline": format_cpu_list(c["cpu"] for c in cpus if not c["online"]),
        "allowed": format_cpu_list(c["cpu"] for c in cpus if c["online"] and c["allowed"]),
    }


def _worker_dict(w) -> dict:
    return {"local_rank": w.local_rank, "cpus": format_cpu_list(w.cpus), "mem_nodes": list(w.mem_nodes),
            "numactl": w.numactl, "env": dict(w.env), "intra_op_threads": w.intra_op_threads,
            "inter_op_threads": w.inter_op_threads, "comm_cpus": format_cpu_list(w.comm_cpus)}


def probe(root: str | None = None) -> dict:
    """The machine (root=None) or a snapshot directory laid out like / (DIR/sys/..., DIR/proc/...)."""
    return _topology_dict(_core.probe_topology(root or "/", root is None))


def plan(workers: int | None = None, root: str | None = None, prefer: str = "socket") -> dict:
    """Topology plus the placement of `workers` (default: one per socket) as `fastxfer topo --json` prints it (docs/topology.md)."""
    native = _core.probe_topology(root or "/", root is None)
    topo = _topology_dict(native)
    n = workers if workers is not None else topo["sockets"]
    p = _core.plan_workers(native, int(n), prefer)
    out = {k: topo[k] for k in ("sockets", "cores", "threads_per_core", "numa_nodes", "isa")}
    out["workers"] = [_worker_dict(w) for w in p.workers]
    out.update(mode=p.mode, precision_policy=p.precision_policy, online=topo["online"],
               offline=topo["offline"], allowed=topo["allowed"], caches=topo["caches"], notes=topo["notes"])
    out["_cpus"] = topo["cpus"]
    return out


def _marks(result: dict) -> dict[int, str]:
    """CPU -> the character that draws it: worker index, '*' reserved for the engine."""
    marks = {}
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    for w in result["workers"]:
        ch = digits[w["local_rank"] % len(digits)]
        for c in parse_cpu_list(w["cpus"]):
            marks[c] = ch
        for c in parse_cpu_list(w["comm_cpus"]):
            marks[c] = "*"
    return marks


def summary(result: dict) -> str:
    """A readable report with a picture: one row per NUMA node, one character per physical core."""
    lines = []
    isa = ", ".join(k for k, v in result["isa"].items() if v) or "none of avx2/f16c/avx512/amx"
    lines.append(f"{result['sockets']} socket(s), {len(result['numa_nodes'])} NUMA node(s), {result['cores']} "
                 f"usable cores x {result['threads_per_core']} thread(s); ISA: {isa}")
    lines.append(f"CPUs online {result['online'] or '-'}, offline {result['offline'] or '-'}, "
                 f"allowed {result['allowed'] or '-'}")
    if result["caches"]:
        lines.append("caches: " + ", ".join(f"L{c['level']} {c['type'].lower()} {c['size_kb']} KiB"
                                            for c in result["caches"]))
    lines.append("")
    lines.append(f"placement ({result['mode']}): one character per physical core — worker number, '*' = core "
                 "kept for the engine, '.' = offline/not allowed")
    marks = _marks(result)
    cpus = result["_cpus"]
    for node in result["numa_nodes"]:
        members = [c for c in cpus if c["node"] == node["id"]]
        cores: dict[tuple, list] = {}
        for c in members:
            cores.setdefault((c["socket"], c["core"]), []).append(c)
        row = ""
        for key in sorted(cores):
            usable = [c for c in cores[key] if c["online"] and c["allowed"]]
            row += marks.get(usable[0]["cpu"], "?") if usable else "."
        sockets = sorted({c["socket"] for c in members})
        where = f"socket {','.join(map(str, sockets))}" if sockets else "memory only"
        lines.append(f"  node {node['id']:>2} ({where}, {node['memory_mb'] / 1024:.1f} GiB) |{row}|")
    lines.append("")
    for w in result["workers"]:
        lines.append(f"  worker {w['local_rank']}: {w['numactl']}  intra-op {w['intra_op_threads']}, inter-op "
                     f"{w['inter_op_threads']}, engine on {w['comm_cpus'] or '(shared cores)'}")
    lines.append(f"  precision: {result['precision_policy']}"
                 + ("  (AMX / AVX-512 BF16 present)" if result["precision_policy"] == "mixed_bfloat16" else ""))
    for n in result["notes"]:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def public_json(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.startswith("_")}


def apply_thread_settings(tf_module=None) -> dict:
    """Give TensorFlow the plan's intra/inter-op thread counts (set by `fastxfer run --bind`) unless
    the user already chose them. Returns what was applied."""
    tf = tf_module if tf_module is not None else sys.modules.get("tensorflow")
    applied = {}
    if tf is None:
        return applied
    threading = tf.config.threading
    for env, get, set_ in (("FASTXFER_INTRA_OP_THREADS", threading.get_intra_op_parallelism_threads,
                            threading.set_intra_op_parallelism_threads),
                           ("FASTXFER_INTER_OP_THREADS", threading.get_inter_op_parallelism_threads,
                            threading.set_inter_op_parallelism_threads)):
        value = settings.get(env)
        if value is None or get() != 0:
            continue  # no plan, or the user set it
        try:
            set_(value)
            applied[env] = value
        except RuntimeError:
            # TensorFlow's runtime is already running: too late to change; leave it.
            pass
    return applied


def add_arguments(p) -> None:
    p.add_argument("--workers", type=int, help="plan this many workers (default: one per socket)")
    p.add_argument("--root", help="read a snapshot laid out like / instead of this machine")
    p.add_argument("--prefer", choices=["socket", "numa"], default="socket",
                   help="which grouping to use when the worker count matches both (default socket)")
    p.add_argument("--json", action="store_true", help="print JSON (its keys: docs/topology.md)")


def main(args) -> int:
    import json

    try:
        result = plan(args.workers, args.root, args.prefer)
    except TopologyError as e:
        print(f"fastxfer topo: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(public_json(result), indent=2))
    else:
        print(summary(result))
    return 0
