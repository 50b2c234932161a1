// Heartbeats between hosts. MPI over TCP has no deadline: a link that goes down while every
// process lives leaves a rank blocked in a send or receive until TCP gives up (many minutes). So
// each rank sends a small UDP datagram to each of its counterparts on the other hosts (the ranks
// of its cross-host group) every `interval` seconds, and a counterpart that was heard from at least
// once and then not for `timeout` seconds is lost: `on_lost` is called once, with a message that
// names its host. Datagrams carry a job token and both ranks, so another job's (or a stray
// sender's) are dropped. A rank that stops cleanly says goodbye, and is never reported lost.
#pragma once
#include <netinet/in.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fastxfer {

struct HeartbeatPeer {
  int rank = -1;                      // global rank
  std::string host;                   // what messages call its host
  std::vector<sockaddr_in> addrs;     // every address it may be reached at (beats go to all)
};

class HostHeartbeat {
 public:
  // Opens the socket (any address, a port the kernel picks). Throws EngineError if it cannot.
  HostHeartbeat();
  ~HostHeartbeat();  // says goodbye to every peer and stops the thread
  HostHeartbeat(const HostHeartbeat&) = delete;
  HostHeartbeat& operator=(const HostHeartbeat&) = delete;

  // What a peer needs to reach this rank: "port addr addr ..." (this host's IPv4 addresses;
  // loopback ones too, for peers on the same machine).
  std::string endpoint() const;
  // Parses a peer's endpoint(); `same_machine`: keep its loopback addresses.
  static std::vector<sockaddr_in> parse_endpoint(const std::string& ep, bool same_machine);

  // Starts beating and watching. `on_lost` runs on the heartbeat thread.
  void start(int my_rank, uint64_t token, std::vector<HeartbeatPeer> peers, double interval_s, double timeout_s,
             std::function<void(const std::string&)> on_lost);

 private:
  void loop();
  void send_all(uint32_t type);

  int fd_ = -1;
  int wake_[2] = {-1, -1};  // a pipe that wakes the thread for stop
  uint16_t port_ = 0;
  int me_ = -1;
  uint64_t token_ = 0;
  std::vector<HeartbeatPeer> peers_;
  double interval_ = 1, timeout_ = 10;
  std::function<void(const std::string&)> on_lost_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace fastxfer
