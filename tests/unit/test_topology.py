"""Topology probe and placement on snapshot machines the tests write (sysfs/procfs trees), and
on the live machine."""

import json
import os
import subprocess
import sys

import pytest

from _launch import fastxfer_cmd, finish, start

from fastxfer import topology
from fastxfer.errors import TopologyError

SPR_FLAGS = "fpu sse sse2 avx avx2 f16c fma avx512f avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile amx_int8"
OLD_FLAGS = "fpu sse sse2 avx avx2 f16c fma"


def cpulist(cpus):
    return topology.format_cpu_list(cpus)


def make_machine(root, sockets=2, cores=56, smt=2, nodes_per_socket=1, offline=(), mem_only=(), cpuset=None,
                 flags=SPR_FLAGS, mem_mb=256 * 1024):
    """Linux numbering: first threads of all cores of all sockets, then the second threads."""
    total = sockets * cores * smt
    cpu_root = root / "sys/devices/system/cpu"
    node_cpus = {}
    for cpu in range(total):
        t, rest = divmod(cpu, sockets * cores)
        s, c = divmod(rest, cores)
        d = cpu_root / f"cpu{cpu}"
        (d / "topology").mkdir(parents=True)
        if cpu in offline:
            (d / "online").write_text("0\n")
            continue
        (d / "online").write_text("1\n")
        (d / "topology/physical_package_id").write_text(f"{s}\n")
        (d / "topology/core_id").write_text(f"{c}\n")
        node = s * nodes_per_socket + c // (cores // nodes_per_socket)
        node_cpus.setdefault(node, []).append(cpu)
    (cpu_root / "online").write_text(cpulist(c for c in range(total) if c not in offline) + "\n")
    cache = cpu_root / "cpu0/cache"
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (2, "Unified", "2048K"), (3, "Unified", "105M")]):
        (cache / f"index{i}").mkdir(parents=True)
        (cache / f"index{i}/level").write_text(f"{level}\n")
        (cache / f"index{i}/type").write_text(f"{kind}\n")
        (cache / f"index{i}/size").write_text(f"{size}\n")
    node_root = root / "sys/devices/system/node"
    n_nodes = sockets * nodes_per_socket
    for n in list(range(n_nodes)) + list(mem_only):
        d = node_root / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist(node_cpus.get(n, [])) + "\n")
        (d / "meminfo").write_text(f"Node {n} MemTotal:       {mem_mb * 1024} kB\nNode {n} MemFree: 1 kB\n")
    (root / "proc").mkdir(parents=True, exist_ok=True)
    (root / "proc/cpuinfo").write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\n")
    if cpuset is not None:
        (root / "sys/fs/cgroup").mkdir(parents=True, exist_ok=True)
        (root / "sys/fs/cgroup/cpuset.cpus.effective").write_text(cpuset + "\n")
    return root


def test_two_socket_server_matches_the_intel_recipe(tmp_path):
    root = make_machine(tmp_path)
    r = topology.plan(2, root=str(root))
    assert (r["sockets"], r["cores"], r["threads_per_core"]) == (2, 112, 2)
    assert [n["cpus"] for n in r["numa_nodes"]] == ["0-55,112-167", "56-111,168-223"]
    assert r["numa_nodes"][0]["memory_mb"] == 256 * 1024
    w0, w1 = r["workers"]
    assert w0["numactl"] == "numactl -C 0-55,112-167 -m 0"
    assert w1["numactl"] == "numactl -C 56-111,168-223 -m 1"
    assert (w0["cpus"], w0["mem_nodes"]) == ("0-55,112-167", [0])
    # cores - 2 for compute, two whole cores (with their siblings) for the engine
    assert w0["intra_op_threads"] == 54 and w0["inter_op_threads"] == 1
    assert w0["comm_cpus"] == "54-55,166-167"
    assert w1["comm_cpus"] == "110-111,222-223"
    env = w0["env"]
    assert env["OMP_NUM_THREADS"] == "54" and env["KMP_BLOCKTIME"] == "1"
    assert env["KMP_AFFINITY"] == "granularity=fine,compact,1,0"
    assert env["TF_NUM_INTRAOP_THREADS"] == "54" and env["FASTXFER_ENGINE_CPUS"] == "54-55,166-167"
    assert r["isa"] == {"avx2": True, "f16c": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": True,
                        "amx_tile": True}
    assert r["precision_policy"] == "mixed_bfloat16" and r["mode"] == "socket"
    assert [c["size_kb"] for c in r["caches"]] == [48, 2048, 105 * 1024]


def test_json_keys_from_the_command(tmp_path):
    root = make_machine(tmp_path)
    out = subprocess.run(fastxfer_cmd() + ["topo", "--root", str(root), "--workers", "2", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    j = json.loads(out.stdout)
    for k in topology.DESIGN_KEYS:
        assert k in j
    assert set(j["workers"][0]) >= {"local_rank", "cpus", "mem_nodes", "numactl", "env", "intra_op_threads",
                                    "inter_op_threads", "comm_cpus"}
    assert set(j["numa_nodes"][0]) == {"id", "cpus", "memory_mb"}
    text = subprocess.run(fastxfer_cmd() + ["topo", "--root", str(root), "--workers", "4"], capture_output=True,
                          text=True, timeout=120).stdout
    # the picture: one row per node, one character per core; worker numbers, '*' for engine cores
    assert "node  0 (socket 0, 256.0 GiB) |" + "0" * 26 + "**" + "1" * 26 + "**|" in text
    assert "worker 3: numactl -C 84-111,196-223 -m 1" in text


def test_several_nodes_per_socket(tmp_path):
    root = make_machine(tmp_path, sockets=2, cores=8, smt=2, nodes_per_socket=2)
    four = topology.plan(4, root=str(root))
    assert four["mode"] == "numa"
    assert [w["numactl"] for w in four["workers"]] == [
        "numactl -C 0-3,16-19 -m 0", "numactl -C 4-7,20-23 -m 1", "numactl -C 8-11,24-27 -m 2",
        "numactl -C 12-15,28-31 -m 3"]
    two = topology.plan(2, root=str(root))
    assert two["mode"] == "socket" and [w["mem_nodes"] for w in two["workers"]] == [[0, 1], [2, 3]]
    numa_first = topology.plan(4, root=str(root), prefer="numa")
    assert numa_first["mode"] == "numa"
    # uneven: even contiguous splits of whole cores
    three = topology.plan(3, root=str(root))
    assert three["mode"] == "split"
    sizes = [len(_cpus(w["cpus"])) // 2 for w in three["workers"]]
    assert sizes == [5, 5, 6] and sum(sizes) == 16


def _cpus(text):
    from fastxfer import _core

    return _core.parse_cpu_list(text)


def test_offline_cpus_get_no_work(tmp_path):
    root = make_machine(tmp_path, sockets=1, cores=4, smt=2, offline={5, 6})
    r = topology.plan(1, root=str(root))
    assert r["offline"] == "5-6" and r["online"] == "0-4,7"
    assert r["workers"][0]["cpus"] == "0-4,7"
    assert r["threads_per_core"] == 2 and r["cores"] == 4


def test_memory_only_node_gets_no_worker(tmp_path):
    root = make_machine(tmp_path, sockets=2, cores=4, smt=1, mem_only=(2,))
    r = topology.plan(3, root=str(root))
    assert r["numa_nodes"][2] == {"id": 2, "cpus": "", "memory_mb": 256 * 1024}
    assert r["mode"] == "split"  # 3 workers: neither 2 sockets nor 2 CPU nodes
    assert all(2 not in w["mem_nodes"] for w in r["workers"])
    assert "memory only" in topology.summary(r)


def test_container_restricted_by_cpuset(tmp_path):
    root = make_machine(tmp_path, sockets=1, cores=8, smt=2, cpuset="2-5,10-13")
    r = topology.plan(2, root=str(root))
    assert r["allowed"] == "2-5,10-13"
    assert [w["cpus"] for w in r["workers"]] == ["2-3,10-11", "4-5,12-13"]
    with pytest.raises(TopologyError, match="5 workers need at least 5 usable physical cores; .* has 4"):
        topology.plan(5, root=str(root))


def test_small_machine_without_smt_or_avx512(tmp_path):
    root = make_machine(tmp_path, sockets=1, cores=4, smt=1, flags=OLD_FLAGS)
    one = topology.plan(1, root=str(root))
    assert one["threads_per_core"] == 1
    assert one["workers"][0]["intra_op_threads"] == 3 and one["workers"][0]["comm_cpus"] == "3"
    assert one["precision_policy"] == "float32"
    assert not one["isa"]["avx512f"] and one["isa"]["avx2"]
    two = topology.plan(2, root=str(root))
    assert [w["comm_cpus"] for w in two["workers"]] == ["", ""]  # 2 cores each: nothing to spare
    assert [w["intra_op_threads"] for w in two["workers"]] == [2, 2]
    assert "FASTXFER_ENGINE_CPUS" not in two["workers"][0]["env"]


@pytest.mark.parametrize("path,content,message", [
    ("sys/devices/system/node/node1/cpulist", "56-x\n", "malformed .*node1/cpulist: '56-x'"),
    ("sys/devices/system/cpu/cpu3/topology/physical_package_id", "zero\n", "physical_package_id: 'zero'"),
    ("sys/devices/system/cpu/online", "0-3,\n", "malformed CPU list in .*cpu/online"),
    ("sys/devices/system/node/node0/meminfo", "Node 0 MemTotal: lots kB\n", "malformed MemTotal in .*node0/meminfo"),
    ("sys/fs/cgroup/cpuset.cpus.effective", "7-2\n", "malformed CPU list in .*cpuset.cpus.effective"),
])
def test_malformed_files_are_named(tmp_path, path, content, message):
    root = make_machine(tmp_path, sockets=2, cores=56, smt=2)
    f = root / path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(content)
    with pytest.raises(TopologyError, match=message):
        topology.plan(2, root=str(root))


def test_missing_tree_and_fallbacks(tmp_path):
    with pytest.raises(TopologyError, match="no CPUs found"):
        topology.probe(str(tmp_path))
    # CPUs without topology files or NUMA directories: documented fallbacks, in the notes
    for c in range(3):
        (tmp_path / f"sys/devices/system/cpu/cpu{c}").mkdir(parents=True)
    r = topology.plan(1, root=str(tmp_path))
    assert r["cores"] == 3 and r["sockets"] == 1 and len(r["numa_nodes"]) == 1
    assert any("no NUMA nodes" in n for n in r["notes"]) and any("no topology/" in n for n in r["notes"])
    assert any("proc/cpuinfo" in n for n in r["notes"])
    out = subprocess.run(fastxfer_cmd() + ["topo", "--root", str(tmp_path / "nothing")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "fastxfer topo: no CPUs found" in out.stderr


def test_live_machine_probe():
    r = topology.plan(1)
    assert r["cores"] >= 1 and r["allowed"] == cpulist(os.sched_getaffinity(0))
    assert r["workers"][0]["cpus"] == r["allowed"]


@pytest.mark.skipif(__import__("importlib").util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
def test_tensorflow_thread_settings_applied_unless_user_set(monkeypatch):
    monkeypatch.setenv("FASTXFER_INTRA_OP_THREADS", "1")
    monkeypatch.setenv("FASTXFER_INTER_OP_THREADS", "1")
    plain = ("import tensorflow as tf, fastxfer.topology as t; "
             "print(t.apply_thread_settings(), tf.config.threading.get_intra_op_parallelism_threads())")
    user_set = ("import tensorflow as tf, fastxfer.topology as t; tf.config.threading.set_intra_op_parallelism_threads(2);"
                "print(t.apply_thread_settings(), tf.config.threading.get_intra_op_parallelism_threads())")
    # two fresh processes side by side: each is mostly TensorFlow's start-up, on one core
    procs = [start([sys.executable, "-c", code], env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
             for code in (plain, user_set)]
    first, second = (finish(p) for p in procs)
    assert "{'FASTXFER_INTRA_OP_THREADS': 1, 'FASTXFER_INTER_OP_THREADS': 1} 1" in first.stdout, first.stderr
    assert "{'FASTXFER_INTER_OP_THREADS': 1} 2" in second.stdout, second.stderr
