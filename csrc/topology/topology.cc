// sysfs/procfs probe and the placement plan. Every read goes through `root`, so a snapshot of
// any machine (tests write several) is planned exactly like the live one.
#include "topology/topology.h"

#include <dirent.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <tuple>

#include "common/cpu_features.h"

namespace fastxfer {

namespace {

bool read_file(const std::string& path, std::string* out) {
  std::ifstream f(path);
  if (!f) return false;
  std::stringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  while (!out->empty() && (out->back() == '\n' || out->back() == ' ')) out->pop_back();
  return true;
}

int parse_int(const std::string& text, const std::string& what) {
  try {
    size_t used = 0;
    int v = std::stoi(text, &used);
    if (used != text.size()) throw std::invalid_argument("trailing");
    return v;
  } catch (const std::exception&) {
    throw TopologyError("malformed " + what + ": '" + text + "' is not an integer");
  }
}

// Numbers of the entries `prefix<N>` in a directory, sorted.
std::vector<int> numbered_entries(const std::string& dir, const std::string& prefix) {
  std::vector<int> out;
  DIR* d = opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    std::string num = name.substr(prefix.size());
    if (num.find_first_not_of("0123456789") != std::string::npos) continue;
    out.push_back(std::stoi(num));
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

uint64_t parse_size_kb(const std::string& text, const std::string& what) {
  if (text.empty()) throw TopologyError("malformed " + what + ": empty");
  char unit = text.back();
  std::string num = (unit == 'K' || unit == 'M' || unit == 'G') ? text.substr(0, text.size() - 1) : text;
  uint64_t v = static_cast<uint64_t>(parse_int(num, what));
  if (unit == 'M') v *= 1024;
  if (unit == 'G') v *= 1024 * 1024;
  if (unit != 'K' && unit != 'M' && unit != 'G') v /= 1024;  // plain bytes
  return v;
}

}  // namespace

std::vector<int> parse_cpu_list(const std::string& text, const std::string& what) {
  std::vector<int> out;
  std::string t = text;
  t.erase(std::remove_if(t.begin(), t.end(), [](char c) { return c == '\n' || c == ' '; }), t.end());
  if (t.empty()) return out;
  const std::string bad = "malformed CPU list in " + what + ": '" + t + "'";
  if (t.back() == ',' || t.front() == ',') throw TopologyError(bad);
  std::stringstream ss(t);
  std::string item;
  try {
    while (std::getline(ss, item, ',')) {
      size_t dash = item.find('-');
      if (item.empty()) throw TopologyError(bad);
      if (dash == std::string::npos) {
        out.push_back(parse_int(item, what));
      } else {
        int a = parse_int(item.substr(0, dash), what);
        int b = parse_int(item.substr(dash + 1), what);
        if (b < a || a < 0) throw TopologyError(bad);
        for (int c = a; c <= b; ++c) out.push_back(c);
      }
    }
  } catch (const TopologyError&) {
    throw TopologyError(bad);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string format_cpu_list(const std::vector<int>& cpus_in) {
  std::vector<int> cpus = cpus_in;
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(cpus[i]);
    if (j > i) out += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

std::vector<int> Topology::usable() const {
  std::vector<int> out;
  for (const auto& c : cpus)
    if (c.online && c.allowed) out.push_back(c.cpu);
  return out;
}

int Topology::sockets() const {
  std::set<int> s;
  for (const auto& c : cpus)
    if (c.online && c.allowed) s.insert(c.socket);
  return static_cast<int>(s.size());
}

int Topology::cores() const {
  std::set<std::pair<int, int>> s;
  for (const auto& c : cpus)
    if (c.online && c.allowed) s.insert({c.socket, c.core});
  return static_cast<int>(s.size());
}

int Topology::threads_per_core() const {
  std::map<std::pair<int, int>, int> n;
  int most = 0;
  for (const auto& c : cpus)
    if (c.online && c.allowed) most = std::max(most, ++n[{c.socket, c.core}]);
  return most;
}

Topology probe_topology(const std::string& root_in, bool live) {
  std::string root = root_in;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  if (root == "/") root.clear();
  const std::string cpu_dir = root + "/sys/devices/system/cpu";
  const std::string node_dir = root + "/sys/devices/system/node";
  Topology t;

  // CPUs and which are online
  std::vector<int> ids = numbered_entries(cpu_dir, "cpu");
  if (ids.empty())
    throw TopologyError("no CPUs found: " + cpu_dir + " has no cpuN entries (is --root a copy of / ?)");
  std::string text;
  std::set<int> online;
  if (read_file(cpu_dir + "/online", &text)) {
    for (int c : parse_cpu_list(text, cpu_dir + "/online")) online.insert(c);
  } else {
    t.notes.push_back("no " + cpu_dir + "/online: read each cpuN/online (cpu0 counts as online)");
    for (int c : ids) {
      std::string v;
      if (!read_file(cpu_dir + "/cpu" + std::to_string(c) + "/online", &v) || v == "1") online.insert(c);
      else if (v != "0") throw TopologyError("malformed " + cpu_dir + "/cpu" + std::to_string(c) + "/online: '" + v + "'");
    }
  }
  bool topo_fallback = false;
  for (int c : ids) {
    CpuEntry e;
    e.cpu = c;
    e.online = online.count(c) > 0;
    const std::string tdir = cpu_dir + "/cpu" + std::to_string(c) + "/topology/";
    std::string pkg, core;
    if (read_file(tdir + "physical_package_id", &pkg) && read_file(tdir + "core_id", &core)) {
      e.socket = parse_int(pkg, tdir + "physical_package_id");
      e.core = parse_int(core, tdir + "core_id");
      if (e.socket < 0) e.socket = 0;  // some VMs report -1
    } else if (e.online) {
      topo_fallback = true;
      e.socket = 0;
      e.core = c;
    }
    t.cpus.push_back(e);
  }
  if (topo_fallback) t.notes.push_back("no topology/ files for some CPUs: each counted as its own core on socket 0");

  // NUMA nodes
  std::vector<int> node_ids = numbered_entries(node_dir, "node");
  std::map<int, int> node_of;
  for (int n : node_ids) {
    NodeEntry ne;
    ne.id = n;
    const std::string nd = node_dir + "/node" + std::to_string(n);
    if (read_file(nd + "/cpulist", &text)) ne.cpus = parse_cpu_list(text, nd + "/cpulist");
    if (read_file(nd + "/meminfo", &text)) {
      std::istringstream ms(text);
      std::string line;
      while (std::getline(ms, line)) {
        size_t p = line.find("MemTotal:");
        if (p == std::string::npos) continue;
        std::istringstream ls(line.substr(p + 9));
        uint64_t kb = 0;
        if (!(ls >> kb)) throw TopologyError("malformed MemTotal in " + nd + "/meminfo: '" + line + "'");
        ne.memory_mb = kb / 1024;
      }
    }
    for (int c : ne.cpus) node_of[c] = n;
    t.nodes.push_back(ne);
  }
  if (t.nodes.empty()) {
    t.notes.push_back("no NUMA nodes under " + node_dir + ": one node with every CPU");
    NodeEntry ne;
    for (const auto& c : t.cpus) ne.cpus.push_back(c.cpu);
    if (read_file(root + "/proc/meminfo", &text)) {
      size_t p = text.find("MemTotal:");
      if (p != std::string::npos) ne.memory_mb = std::stoull(text.substr(p + 9)) / 1024;
    }
    t.nodes.push_back(ne);
  }
  for (auto& c : t.cpus) c.node = node_of.count(c.cpu) ? node_of[c.cpu] : t.nodes.front().id;

  // CPUs this process may use
  std::set<int> allowed;
  bool restrict_allowed = false;
  if (live) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      restrict_allowed = true;
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &set)) allowed.insert(c);
    }
  } else if (read_file(root + "/sys/fs/cgroup/cpuset.cpus.effective", &text)) {
    restrict_allowed = true;
    for (int c : parse_cpu_list(text, root + "/sys/fs/cgroup/cpuset.cpus.effective")) allowed.insert(c);
  }
  if (restrict_allowed)
    for (auto& c : t.cpus) c.allowed = allowed.count(c.cpu) > 0;

  // caches of the first online CPU
  int first = -1;
  for (const auto& c : t.cpus)
    if (c.online) {
      first = c.cpu;
      break;
    }
  if (first >= 0) {
    const std::string cdir = cpu_dir + "/cpu" + std::to_string(first) + "/cache";
    for (int i : numbered_entries(cdir, "index")) {
      const std::string id = cdir + "/index" + std::to_string(i) + "/";
      std::string level, type, size;
      if (!read_file(id + "level", &level) || !read_file(id + "size", &size)) continue;
      read_file(id + "type", &type);
      t.caches.push_back({parse_int(level, id + "level"), type, parse_size_kb(size, id + "size")});
    }
  }

  // ISA
  if (live) {
    const CpuFeatures& f = cpu_features();
    t.isa = {f.avx2, f.f16c, f.avx512f, f.avx512_bf16, f.amx_bf16, f.amx_tile};
  } else if (read_file(root + "/proc/cpuinfo", &text)) {
    std::istringstream cs(text);
    std::string line;
    while (std::getline(cs, line)) {
      if (line.compare(0, 5, "flags") != 0) continue;
      std::istringstream fs(line.substr(line.find(':') + 1));
      std::set<std::string> flags;
      std::string w;
      while (fs >> w) flags.insert(w);
      t.isa = {flags.count("avx2") > 0,       flags.count("f16c") > 0,     flags.count("avx512f") > 0,
               flags.count("avx512_bf16") > 0, flags.count("amx_bf16") > 0, flags.count("amx_tile") > 0};
      break;
    }
  } else {
    t.notes.push_back("no " + root + "/proc/cpuinfo: ISA features unknown (all false)");
  }
  if (t.usable().empty()) throw TopologyError("no CPU is both online and allowed for this process");
  return t;
}

Plan plan_workers(const Topology& t, int n, const std::string& prefer) {
  if (n < 1) throw TopologyError("the number of workers must be at least 1, got " + std::to_string(n));
  if (prefer != "socket" && prefer != "numa")
    throw TopologyError("prefer must be 'socket' or 'numa', not '" + prefer + "'");
  // usable physical cores, in order socket, node, core id
  struct Core {
    int socket, node, id;
    std::vector<int> cpus;
  };
  std::map<std::pair<int, int>, Core> by_id;
  for (const auto& c : t.cpus) {
    if (!c.online || !c.allowed) continue;
    auto& core = by_id[{c.socket, c.core}];
    if (core.cpus.empty()) core = {c.socket, c.node, c.core, {}};
    core.cpus.push_back(c.cpu);
  }
  std::vector<Core> cores;
  for (auto& kv : by_id) cores.push_back(kv.second);
  std::sort(cores.begin(), cores.end(), [](const Core& a, const Core& b) {
    return std::tie(a.socket, a.node, a.id) < std::tie(b.socket, b.node, b.id);
  });
  if (static_cast<int>(cores.size()) < n)
    throw TopologyError(std::to_string(n) + " workers need at least " + std::to_string(n) +
                        " usable physical cores; this machine (or cpuset) has " + std::to_string(cores.size()));

  std::vector<std::vector<const Core*>> groups;
  auto group_by = [&](auto key) {
    std::map<int, std::vector<const Core*>> g;
    for (const auto& c : cores) g[key(c)].push_back(&c);
    std::vector<std::vector<const Core*>> out;
    for (auto& kv : g) out.push_back(kv.second);
    return out;
  };
  auto per_socket = group_by([](const Core& c) { return c.socket; });
  auto per_node = group_by([](const Core& c) { return c.node; });
  Plan plan;
  const auto& first = prefer == "socket" ? per_socket : per_node;
  const auto& second = prefer == "socket" ? per_node : per_socket;
  if (static_cast<int>(first.size()) == n) {
    groups = first;
    plan.mode = prefer;
  } else if (static_cast<int>(second.size()) == n) {
    groups = second;
    plan.mode = prefer == "socket" ? "numa" : "socket";
  } else {
    plan.mode = "split";
    const size_t total = cores.size();
    for (int i = 0; i < n; ++i) {
      std::vector<const Core*> g;
      for (size_t k = total * i / n; k < total * (i + 1) / n; ++k) g.push_back(&cores[k]);
      groups.push_back(g);
    }
  }

  for (int i = 0; i < n; ++i) {
    const auto& g = groups[i];
    WorkerPlacement w;
    w.local_rank = i;
    std::set<int> nodes;
    for (const Core* c : g) {
      w.cpus.insert(w.cpus.end(), c->cpus.begin(), c->cpus.end());
      nodes.insert(c->node);
    }
    std::sort(w.cpus.begin(), w.cpus.end());
    w.mem_nodes.assign(nodes.begin(), nodes.end());
    // Leave cores for the engine's threads when there are enough (Intel's recipe: cores - 2).
    const int ncores = static_cast<int>(g.size());
    const int reserve = ncores >= 8 ? 2 : ncores >= 4 ? 1 : 0;
    for (int k = ncores - reserve; k < ncores; ++k) w.comm_cpus.insert(w.comm_cpus.end(), g[k]->cpus.begin(), g[k]->cpus.end());
    std::sort(w.comm_cpus.begin(), w.comm_cpus.end());
    w.intra_op_threads = ncores - reserve;
    w.inter_op_threads = 1;
    w.numactl = "numactl -C " + format_cpu_list(w.cpus) + " -m " + format_cpu_list(w.mem_nodes);
    const std::string intra = std::to_string(w.intra_op_threads), inter = std::to_string(w.inter_op_threads);
    w.env = {{"OMP_NUM_THREADS", intra},
             {"KMP_BLOCKTIME", "1"},
             {"KMP_AFFINITY", "granularity=fine,compact,1,0"},
             {"TF_NUM_INTRAOP_THREADS", intra},
             {"TF_NUM_INTEROP_THREADS", inter},
             {"FASTXFER_INTRA_OP_THREADS", intra},
             {"FASTXFER_INTER_OP_THREADS", inter}};
    if (!w.comm_cpus.empty()) w.env["FASTXFER_ENGINE_CPUS"] = format_cpu_list(w.comm_cpus);
    plan.workers.push_back(w);
  }
  plan.precision_policy = (t.isa.amx_bf16 || t.isa.avx512_bf16) ? "mixed_bfloat16" : "float32";
  return plan;
}

void bind_cpus(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) throw TopologyError("CPU " + std::to_string(c) + " is out of range");
    CPU_SET(c, &set);
  }
  if (sched_setaffinity(0, sizeof(set), &set) != 0)
    throw TopologyError("sched_setaffinity(" + format_cpu_list(cpus) + ") failed: " + std::strerror(errno));
}

void bind_memory(const std::vector<int>& nodes) {
  constexpr int kMpolBind = 2;  // MPOL_BIND from <linux/mempolicy.h>
  constexpr int kMaxNode = 1024;
  unsigned long mask[kMaxNode / (8 * sizeof(unsigned long))] = {};
  for (int n : nodes) {
    if (n < 0 || n >= kMaxNode) throw TopologyError("NUMA node " + std::to_string(n) + " is out of range");
    mask[n / (8 * sizeof(unsigned long))] |= 1ul << (n % (8 * sizeof(unsigned long)));
  }
  if (syscall(SYS_set_mempolicy, kMpolBind, mask, kMaxNode + 1) != 0)
    throw TopologyError("set_mempolicy(MPOL_BIND, nodes " + format_cpu_list(nodes) + ") failed: " +
                        std::strerror(errno));
}

}  // namespace fastxfer
