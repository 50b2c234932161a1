// What the machine looks like (sockets, NUMA nodes, cores, SMT siblings, caches, ISA) from sysfs
// and procfs, and where N workers on it should run.
#pragma once
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace fastxfer {

// A topology file is missing where it must exist, or malformed: the message names the file.
class TopologyError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct CpuEntry {
  int cpu = 0;
  int socket = 0;
  int core = 0;  // core_id (unique within its socket)
  int node = 0;
  bool online = true;
  bool allowed = true;
};

struct NodeEntry {
  int id = 0;
  std::vector<int> cpus;  // all CPUs sysfs lists for the node (online or not)
  uint64_t memory_mb = 0;
};

struct CacheEntry {
  int level = 0;
  std::string type;
  uint64_t size_kb = 0;
};

struct Isa {
  bool avx2 = false, f16c = false, avx512f = false, avx512_bf16 = false, amx_bf16 = false, amx_tile = false;
};

struct Topology {
  std::vector<CpuEntry> cpus;  // every CPU directory found, sorted by number
  std::vector<NodeEntry> nodes;
  std::vector<CacheEntry> caches;  // of CPU 0 (or the first online CPU)
  Isa isa;
  std::vector<std::string> notes;  // fallbacks taken, in words

  int sockets() const;           // sockets with at least one usable CPU
  int cores() const;             // usable physical cores
  int threads_per_core() const;  // most usable SMT siblings on one core
  std::vector<int> usable() const;  // online and allowed
};

// root == "/" and live == true: this machine (allowed CPUs from the affinity mask, ISA from cpuid).
// Otherwise a snapshot laid out like / under `root` (allowed CPUs from cgroup v2
// cpuset.cpus.effective when present, ISA from proc/cpuinfo flags).
Topology probe_topology(const std::string& root, bool live);

struct WorkerPlacement {
  int local_rank = 0;
  std::vector<int> cpus;       // whole cores, SMT siblings included
  std::vector<int> mem_nodes;  // NUMA nodes under those CPUs
  std::vector<int> comm_cpus;  // the reserved cores, for the engine's threads
  int intra_op_threads = 1;
  int inter_op_threads = 1;
  std::string numactl;
  std::map<std::string, std::string> env;
};

struct Plan {
  std::string mode;  // "socket", "numa" or "split"
  std::vector<WorkerPlacement> workers;
  std::string precision_policy;  // "mixed_bfloat16" when AMX or AVX-512 BF16 is present, else "float32"
};

// prefer: "socket" (one worker per socket when N equals the socket count, else per NUMA node when
// N equals the node count) or "numa" (the other way round); otherwise even contiguous splits.
// Throws TopologyError when there are fewer usable cores than workers.
Plan plan_workers(const Topology& topo, int workers, const std::string& prefer);

// "0-3,8,10-11": sorted, ranges joined with '-', items with ','.
std::string format_cpu_list(const std::vector<int>& cpus);
// Throws TopologyError naming `what` on malformed input.
std::vector<int> parse_cpu_list(const std::string& text, const std::string& what);

// Binding with the system calls themselves (no libnuma): CPUs of the calling thread/process,
// and MPOL_BIND of its future allocations to `nodes`. Throw TopologyError with errno text.
void bind_cpus(const std::vector<int>& cpus);
void bind_memory(const std::vector<int>& nodes);

}  // namespace fastxfer
