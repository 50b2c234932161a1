#include "transport/heartbeat.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "common/errors.h"

namespace fastxfer {

namespace {

constexpr uint32_t kMagic = 0x42485846;  // "FXHB"
constexpr uint32_t kBeat = 1, kBye = 2;

struct Packet {
  uint32_t magic;
  uint32_t type;
  uint64_t token;
  int32_t from;
  int32_t to;
  uint64_t seq;
};
static_assert(sizeof(Packet) == 32, "heartbeat datagrams are 32 bytes");

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool loopback(const in_addr& a) { return (ntohl(a.s_addr) >> 24) == 127; }

}  // namespace

HostHeartbeat::HostHeartbeat() {
  fd_ = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd_ < 0) throw EngineError(std::string("heartbeat between hosts: cannot open a UDP socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0 || pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    const int e = errno;
    close(fd_);
    if (wake_[0] >= 0) close(wake_[0]);
    if (wake_[1] >= 0) close(wake_[1]);
    throw EngineError(std::string("heartbeat between hosts: cannot bind a UDP socket: ") + std::strerror(e));
  }
  port_ = ntohs(a.sin_port);
}

HostHeartbeat::~HostHeartbeat() {
  if (thread_.joinable()) {
    stop_.store(true);
    const char c = 1;
    (void)!write(wake_[1], &c, 1);
    thread_.join();
    send_all(kBye);
  }
  close(fd_);
  close(wake_[0]);
  close(wake_[1]);
}

std::string HostHeartbeat::endpoint() const {
  std::ostringstream s;
  s << port_;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
      char buf[INET_ADDRSTRLEN];
      const auto* sin = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
      if (inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof buf)) s << ' ' << buf;
    }
    freeifaddrs(list);
  }
  return s.str();
}

std::vector<sockaddr_in> HostHeartbeat::parse_endpoint(const std::string& ep, bool same_machine) {
  std::istringstream s(ep);
  unsigned port = 0;
  std::vector<sockaddr_in> out;
  if (!(s >> port) || port == 0 || port > 65535) return out;
  std::string addr;
  while (s >> addr) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (inet_pton(AF_INET, addr.c_str(), &a.sin_addr) != 1) continue;
    if (loopback(a.sin_addr) && !same_machine) continue;  // would reach this host, not the peer's
    out.push_back(a);
  }
  return out;
}

void HostHeartbeat::start(int my_rank, uint64_t token, std::vector<HeartbeatPeer> peers, double interval_s,
                          double timeout_s, std::function<void(const std::string&)> on_lost) {
  me_ = my_rank;
  token_ = token;
  peers_ = std::move(peers);
  interval_ = interval_s;
  timeout_ = timeout_s;
  on_lost_ = std::move(on_lost);
  thread_ = std::thread([this] { loop(); });
  pthread_setname_np(thread_.native_handle(), "fastxfer-beat");
}

void HostHeartbeat::send_all(uint32_t type) {
  static thread_local uint64_t seq = 0;
  for (const HeartbeatPeer& p : peers_) {
    Packet pk{kMagic, type, token_, me_, p.rank, ++seq};
    for (const sockaddr_in& a : p.addrs)  // errors (a link that is down) are what the deadline is for
      (void)sendto(fd_, &pk, sizeof pk, MSG_DONTWAIT | MSG_NOSIGNAL, reinterpret_cast<const sockaddr*>(&a), sizeof a);
  }
}

void HostHeartbeat::loop() {
  const size_t n = peers_.size();
  std::vector<double> last(n, 0.0);
  std::vector<char> heard(n, 0), gone(n, 0);
  double next_beat = 0, prev = now_s();
  bool fired = false;
  while (!stop_.load()) {
    double t = now_s();
    if (t >= next_beat) {
      send_all(kBeat);
      next_beat = t + interval_;
    }
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    const int ms = std::max(1, static_cast<int>((next_beat - t) * 1000));
    (void)poll(fds, 2, ms);
    if (stop_.load()) break;
    Packet pk;
    ssize_t got;
    while ((got = recv(fd_, &pk, sizeof pk, MSG_DONTWAIT)) >= 0) {
      if (got != static_cast<ssize_t>(sizeof pk) || pk.magic != kMagic || pk.token != token_ || pk.to != me_) continue;
      for (size_t j = 0; j < n; ++j)
        if (peers_[j].rank == pk.from) {
          if (pk.type == kBye) gone[j] = 1;
          last[j] = now_s();
          heard[j] = 1;
        }
    }
    t = now_s();
    // This thread itself was not running for a while (the machine overloaded, the process
    // stopped): silence over that time says nothing about the peers. Start their clocks afresh.
    if (t - prev > timeout_ / 2)
      for (double& l : last) l = t;
    prev = t;
    if (fired) continue;  // keep beating: the peers decide for themselves
    std::vector<size_t> lost;
    for (size_t j = 0; j < n; ++j)
      if (heard[j] && !gone[j] && t - last[j] > timeout_) lost.push_back(j);
    if (lost.empty()) continue;
    fired = true;
    std::ostringstream host, ranks;
    for (size_t k = 0; k < lost.size(); ++k) {
      const HeartbeatPeer& p = peers_[lost[k]];
      if (host.str().find(p.host) == std::string::npos) host << (host.tellp() > 0 ? ", " : "") << p.host;
      ranks << (k ? ", " : "") << p.rank;
    }
    char secs[32], limit[32];
    std::snprintf(secs, sizeof secs, "%.1f", t - last[lost[0]]);
    std::snprintf(limit, sizeof limit, "%g", timeout_);
    const std::string msg = "lost host " + host.str() + " (rank " + ranks.str() + "): no heartbeat from it for " +
                            secs + " s across the network (FASTXFER_HOST_TIMEOUT=" + limit +
                            "); its link went down, or the host did. The job cannot go on without it: restart it "
                            "on the hosts that are up";
    // On stderr too, for `fastxfer run --hosts`, which stops mpirun once a rank says this.
    std::fprintf(stderr, "fastxfer: rank %d: %s\n", me_, msg.c_str());
    std::fflush(stderr);
    on_lost_(msg);
  }
}

}  // namespace fastxfer
