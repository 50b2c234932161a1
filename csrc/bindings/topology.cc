// fastxfer._core: the topology probe, the placement plan, CPU lists and binding.
#include <pybind11/stl.h>

#include <string>

#include "bindings/arrays.h"
#include "topology/topology.h"

namespace fastxfer {
namespace bindings {

void bind_topology(py::module_& m) {
  py::class_<CpuEntry>(m, "CpuEntry", "One logical CPU as sysfs describes it.")
      .def_readonly("cpu", &CpuEntry::cpu)
      .def_readonly("socket", &CpuEntry::socket)
      .def_readonly("core", &CpuEntry::core)
      .def_readonly("node", &CpuEntry::node)
      .def_readonly("online", &CpuEntry::online)
      .def_readonly("allowed", &CpuEntry::allowed);
  py::class_<NodeEntry>(m, "NodeEntry", "One NUMA node: its CPUs (online or not) and memory.")
      .def_readonly("id", &NodeEntry::id)
      .def_readonly("cpus", &NodeEntry::cpus)
      .def_readonly("memory_mb", &NodeEntry::memory_mb);
  py::class_<CacheEntry>(m, "CacheEntry", "One cache of the first usable CPU.")
      .def_readonly("level", &CacheEntry::level)
      .def_readonly("type", &CacheEntry::type)
      .def_readonly("size_kb", &CacheEntry::size_kb);
  py::class_<Isa>(m, "Isa", "The instruction-set features placement and precision depend on.")
      .def_readonly("avx2", &Isa::avx2)
      .def_readonly("f16c", &Isa::f16c)
      .def_readonly("avx512f", &Isa::avx512f)
      .def_readonly("avx512_bf16", &Isa::avx512_bf16)
      .def_readonly("amx_bf16", &Isa::amx_bf16)
      .def_readonly("amx_tile", &Isa::amx_tile);
  py::class_<Topology>(m, "Topology", "The machine (or a snapshot of one) as probe_topology found it.")
      .def_readonly("cpus", &Topology::cpus)
      .def_readonly("nodes", &Topology::nodes)
      .def_readonly("caches", &Topology::caches)
      .def_readonly("isa", &Topology::isa)
      .def_readonly("notes", &Topology::notes)
      .def_property_readonly("sockets", &Topology::sockets)
      .def_property_readonly("cores", &Topology::cores)
      .def_property_readonly("threads_per_core", &Topology::threads_per_core);
  py::class_<WorkerPlacement>(m, "WorkerPlacement", "Where one local worker runs and how many threads it uses.")
      .def_readonly("local_rank", &WorkerPlacement::local_rank)
      .def_readonly("cpus", &WorkerPlacement::cpus)
      .def_readonly("mem_nodes", &WorkerPlacement::mem_nodes)
      .def_readonly("comm_cpus", &WorkerPlacement::comm_cpus)
      .def_readonly("intra_op_threads", &WorkerPlacement::intra_op_threads)
      .def_readonly("inter_op_threads", &WorkerPlacement::inter_op_threads)
      .def_readonly("numactl", &WorkerPlacement::numactl)
      .def_readonly("env", &WorkerPlacement::env);
  py::class_<Plan>(m, "Plan", "The placement of N workers on a topology.")
      .def_readonly("mode", &Plan::mode)
      .def_readonly("workers", &Plan::workers)
      .def_readonly("precision_policy", &Plan::precision_policy);
  m.def("probe_topology", &probe_topology, py::arg("root") = "/", py::arg("live") = true,
        "root='/' and live=True: this machine; otherwise a snapshot laid out like / under root.");
  m.def("plan_workers", &plan_workers, py::arg("topology"), py::arg("workers"), py::arg("prefer") = "socket");
  m.def("format_cpu_list", &format_cpu_list, py::arg("cpus"));
  m.def("parse_cpu_list", [](const std::string& s) { return parse_cpu_list(s, "argument"); }, py::arg("text"));
  m.def("bind_cpus", &bind_cpus, py::arg("cpus"));
  m.def("bind_memory", &bind_memory, py::arg("nodes"));
}

}  // namespace bindings
}  // namespace fastxfer
