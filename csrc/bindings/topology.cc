// fastxfer._core: the topology probe, the placement plan, CPU lists and binding.
#include <pybind11/stl.h>

#include <string>

#include "bindings/arrays.h"
#include "topology/topology.h"

namespace fastxfer {
namespace bindings {

void bind_topology(py::module_& m) {
  m.def(
      "probe_topology",
      [](const std::string& root, bool live) {
        Topology t = probe_topology(root, live);
        py::list cpus, nodes, caches;
        for (const auto& c : t.cpus) {
          py::dict d;
          d["cpu"] = c.cpu;
          d["socket"] = c.socket;
          d["core"] = c.core;
          d["node"] = c.node;
          d["online"] = c.online;
          d["allowed"] = c.allowed;
          cpus.append(d);
        }
        for (const auto& n : t.nodes) {
          py::dict d;
          d["id"] = n.id;
          d["cpus"] = format_cpu_list(n.cpus);
          d["memory_mb"] = n.memory_mb;
          nodes.append(d);
        }
        for (const auto& c : t.caches) {
          py::dict d;
          d["level"] = c.level;
          d["type"] = c.type;
          d["size_kb"] = c.size_kb;
          caches.append(d);
        }
        py::dict isa;
        isa["avx2"] = t.isa.avx2;
        isa["f16c"] = t.isa.f16c;
        isa["avx512f"] = t.isa.avx512f;
        isa["avx512_bf16"] = t.isa.avx512_bf16;
        isa["amx_bf16"] = t.isa.amx_bf16;
        isa["amx_tile"] = t.isa.amx_tile;
        py::dict out;
        out["sockets"] = t.sockets();
        out["cores"] = t.cores();
        out["threads_per_core"] = t.threads_per_core();
        out["cpus"] = cpus;
        out["numa_nodes"] = nodes;
        out["caches"] = caches;
        out["isa"] = isa;
        out["notes"] = t.notes;
        return out;
      },
      py::arg("root") = "/", py::arg("live") = true);
  m.def(
      "plan_workers",
      [](const std::string& root, bool live, int workers, const std::string& prefer) {
        Plan p = plan_workers(probe_topology(root, live), workers, prefer);
        py::list ws;
        for (const auto& w : p.workers) {
          py::dict d;
          d["local_rank"] = w.local_rank;
          d["cpus"] = format_cpu_list(w.cpus);
          d["mem_nodes"] = w.mem_nodes;
          d["numactl"] = w.numactl;
          d["env"] = w.env;
          d["intra_op_threads"] = w.intra_op_threads;
          d["inter_op_threads"] = w.inter_op_threads;
          d["comm_cpus"] = format_cpu_list(w.comm_cpus);
          ws.append(d);
        }
        py::dict out;
        out["mode"] = p.mode;
        out["workers"] = ws;
        out["precision_policy"] = p.precision_policy;
        return out;
      },
      py::arg("root"), py::arg("live"), py::arg("workers"), py::arg("prefer") = "socket");
  m.def("format_cpu_list", &format_cpu_list, py::arg("cpus"));
  m.def("parse_cpu_list", [](const std::string& s) { return parse_cpu_list(s, "argument"); }, py::arg("text"));
  m.def("bind_cpus", &bind_cpus, py::arg("cpus"));
  m.def("bind_memory", &bind_memory, py::arg("nodes"));
}

}  // namespace bindings
}  // namespace fastxfer
