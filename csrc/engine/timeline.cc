#include "engine/timeline.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

namespace fastxfer {

namespace {

double steady_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr size_t kFlushBytes = 1 << 20;

// The timeline file, opened for writing as docs/reliability.md promises: never through a link
// planted at its name (O_NOFOLLOW), never another user's file or anything but a regular file,
// mode 0600 (tensor names and timings are not for other users), emptied once it is known to be ours.
bool is_link(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

std::FILE* open_private(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int e = errno;
    throw std::runtime_error("cannot write the timeline " + path + ": " +
                             // ELOOP from O_NOFOLLOW; EACCES where the kernel refuses links in sticky folders first
                             (e == ELOOP || (e == EACCES && is_link(path))
                                  ? std::string("it is a symbolic link (fastxfer does not write through links)")
                                  : std::string(std::strerror(e))));
  }
  struct stat st;
  std::string why;
  if (fstat(fd, &st) != 0) why = std::strerror(errno);
  else if (!S_ISREG(st.st_mode)) why = "not a regular file";
  else if (st.st_uid != geteuid()) why = "it belongs to uid " + std::to_string(st.st_uid) + ", not this user";
  else if (fchmod(fd, 0600) != 0 || ftruncate(fd, 0) != 0) why = std::strerror(errno);
  std::FILE* f = why.empty() ? fdopen(fd, "w") : nullptr;
  if (f == nullptr) {
    if (why.empty()) why = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("cannot write the timeline " + path + ": " + why);
  }
  return f;
}

}  // namespace

Timeline::Timeline(const std::string& path, int rank, double offset_us, bool mark_cycles)
    : rank_(rank), offset_(offset_us) {
  if (!path.empty()) start(path, mark_cycles);
}

void Timeline::start(const std::string& path, bool mark_cycles) {
  close();
  std::lock_guard<std::mutex> lk(mu_);
  file_ = open_private(path);
  lanes_.clear();
  buf_ = "[\n";
  buf_ += "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": " + std::to_string(rank_) +
          ", \"args\": {\"name\": \"rank " + std::to_string(rank_) + "\"}}";
  buf_ += ",\n{\"ph\": \"M\", \"name\": \"process_sort_index\", \"pid\": " + std::to_string(rank_) +
          ", \"args\": {\"sort_index\": " + std::to_string(rank_) + "}}";
  buf_ += ",\n{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": " + std::to_string(rank_) +
          ", \"tid\": 0, \"args\": {\"name\": \"engine\"}}";
  buf_ += ",\n{\"ph\": \"M\", \"name\": \"thread_sort_index\", \"pid\": " + std::to_string(rank_) +
          ", \"tid\": 0, \"args\": {\"sort_index\": -1}}";
  mark_cycles_ = mark_cycles;
  on_ = true;
}

void Timeline::cycle() {
  if (!enabled() || !mark_cycles_.load(std::memory_order_relaxed)) return;
  char head[128];
  std::snprintf(head, sizeof head, ",\n{\"ph\": \"i\", \"s\": \"t\", \"pid\": %d, \"tid\": 0, \"ts\": %.3f, ", rank_,
                now());
  std::lock_guard<std::mutex> lk(mu_);
  if (file_ == nullptr) return;
  buf_ += head;
  buf_ += "\"cat\": \"cycle\", \"name\": \"CYCLE_START\"}";
  if (buf_.size() >= kFlushBytes) flush_locked();
}

Timeline::~Timeline() { close(); }

double Timeline::now() const { return steady_us() + offset_; }

std::string Timeline::escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else {
      o += c;
    }
  }
  return o;
}

int Timeline::lane(const std::string& tensor) {
  if (!enabled()) return 0;
  std::lock_guard<std::mutex> lk(mu_);
  if (file_ == nullptr) return 0;
  auto it = lanes_.find(tensor);
  if (it != lanes_.end()) return it->second;
  int id;
  std::string label = tensor;
  if (static_cast<int>(lanes_.size()) >= kMaxLanes) {
    id = kMaxLanes + 1;
    label = "other tensors";
    if (lanes_.count("\x01other")) return id;
    lanes_["\x01other"] = id;
  } else {
    id = static_cast<int>(lanes_.size()) + 1;
    lanes_[tensor] = id;
  }
  buf_ += ",\n{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": " + std::to_string(rank_) +
          ", \"tid\": " + std::to_string(id) + ", \"args\": {\"name\": \"" + escape(label) + "\"}}";
  buf_ += ",\n{\"ph\": \"M\", \"name\": \"thread_sort_index\", \"pid\": " + std::to_string(rank_) +
          ", \"tid\": " + std::to_string(id) + ", \"args\": {\"sort_index\": " + std::to_string(id) + "}}";
  return id;
}

void Timeline::span(int lane, const char* cat, const std::string& name, double t0, double t1,
                    const std::string& args) {
  if (!enabled()) return;
  char head[160];
  std::snprintf(head, sizeof head, ",\n{\"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"ts\": %.3f, \"dur\": %.3f, \"cat\": \"",
                rank_, lane, t0, t1 > t0 ? t1 - t0 : 0.0);
  std::lock_guard<std::mutex> lk(mu_);
  if (file_ == nullptr) return;
  buf_ += head;
  buf_ += cat;
  buf_ += "\", \"name\": \"" + escape(name) + "\"";
  if (!args.empty()) buf_ += ", \"args\": {" + args + "}";
  buf_ += "}";
  ++events_;
  if (buf_.size() >= kFlushBytes) flush_locked();
}

void Timeline::mark(const std::string& name) {
  if (!enabled()) return;
  char head[128];
  std::snprintf(head, sizeof head, ",\n{\"ph\": \"i\", \"s\": \"p\", \"pid\": %d, \"tid\": 0, \"ts\": %.3f, ", rank_,
                now());
  std::lock_guard<std::mutex> lk(mu_);
  if (file_ == nullptr) return;
  buf_ += head;
  buf_ += "\"cat\": \"step\", \"name\": \"" + escape(name) + "\"}";
  if (buf_.size() >= kFlushBytes) flush_locked();
}

void Timeline::flush_locked() {
  if (file_ == nullptr || buf_.empty()) return;
  std::fwrite(buf_.data(), 1, buf_.size(), file_);
  std::fflush(file_);
  buf_.clear();
}

void Timeline::close() {
  std::lock_guard<std::mutex> lk(mu_);
  if (file_ == nullptr) return;
  on_ = false;
  buf_ += "\n]\n";
  flush_locked();
  std::fclose(file_);
  file_ = nullptr;
}

}  // namespace fastxfer
