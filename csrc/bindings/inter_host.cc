// PyInterHost: transport/inter_host.h on a Python object (mpi4py underneath).
#include "bindings/inter_host.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "common/request.h"
#include "transport/mpi_native.h"

namespace fastxfer {
namespace bindings {

namespace py = pybind11;

namespace {

// InterHost implemented by a Python object (fastxfer.comm.mpi.MPIInterHost, on mpi4py).
// Called from the engine thread: takes the GIL for each call; buffers are passed as numpy views
// (no copy) of raw bytes, with the element dtype named separately.
class PyInterHost : public InterHost {
 public:
  explicit PyInterHost(py::object impl) : impl_(std::move(impl)) {
    rank_ = impl_.attr("rank").cast<int>();
    size_ = impl_.attr("size").cast<int>();
  }
  ~PyInterHost() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void allreduce_shard(void* buf, size_t n, DType dtype, ReduceOp op) override {
    py::gil_scoped_acquire gil;
    impl_.attr("allreduce_shard")(view(buf, n * dtype_size(dtype)), dtype_name(dtype), op_name(op));
  }
  std::vector<std::vector<char>> allgather_bytes_across(const std::vector<char>& mine) override {
    return gather(mine, "allgather_bytes_across");
  }
  std::vector<std::vector<char>> allgather_bytes(const std::vector<char>& mine) override {
    return gather(mine, "allgather_bytes");
  }
  std::vector<std::vector<char>> gather(const std::vector<char>& mine, const char* method) {
    py::gil_scoped_acquire gil;
    py::list got = impl_.attr(method)(py::bytes(mine.data(), mine.size()));
    std::vector<std::vector<char>> out;
    for (auto item : got) {
      std::string b = item.cast<std::string>();
      out.emplace_back(b.begin(), b.end());
    }
    return out;
  }
  void broadcast(void* buf, size_t nbytes, int root) override {
    py::gil_scoped_acquire gil;
    impl_.attr("broadcast")(view(buf, nbytes), root);
  }
  void allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) override {
    py::gil_scoped_acquire gil;
    size_t total = 0;
    for (size_t b : bytes) total += b;
    impl_.attr("allgatherv")(view(const_cast<void*>(in), bytes[rank_]), view(out, total), bytes);
  }
  void alltoallv(const void* in, void* out, const std::vector<size_t>& send_bytes,
                 const std::vector<size_t>& recv_bytes) override {
    py::gil_scoped_acquire gil;
    size_t sent = 0, got = 0;
    for (size_t b : send_bytes) sent += b;
    for (size_t b : recv_bytes) got += b;
    impl_.attr("alltoallv")(view(const_cast<void*>(in), sent), view(out, got), send_bytes, recv_bytes);
  }
  void oob_allreduce(const void* in, void* out, size_t n, DType dtype, ReduceOp op,
                     const std::string& what) override {
    py::gil_scoped_acquire gil;
    try {
      impl_.attr("oob_allreduce")(view(const_cast<void*>(in), n * dtype_size(dtype)),
                                  view(out, n * dtype_size(dtype)), dtype_name(dtype), op_name(op), what);
    } catch (py::error_already_set& e) {
      // keep the engine's error model: a disagreement poisons the group on every rank
      if (e.matches(py::module_::import("fastxfer.errors").attr("MismatchError"))) throw Mismatch(e.what());
      throw;
    }
  }

 private:
  static py::array view(void* p, size_t nbytes) {
    static char empty;  // an empty buffer (an alltoall block of no rows) may come as a null pointer
    if (p == nullptr) p = &empty;
    py::capsule keep(p, [](void*) {});  // the transport owns the memory; the view must not outlive the call
    return py::array(py::dtype("uint8"), {static_cast<py::ssize_t>(nbytes)}, {1}, static_cast<uint8_t*>(p), keep);
  }
  py::object impl_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

namespace {

// The native link, holding the Python object that owns its communicators (released with the GIL).
class OwnedNativeMPI : public NativeMPIInterHost {
 public:
  OwnedNativeMPI(const NativeMPIConfig& cfg, py::object owner) : NativeMPIInterHost(cfg), owner_(std::move(owner)) {}
  ~OwnedNativeMPI() override {
    py::gil_scoped_acquire gil;
    owner_ = py::object();
  }

 private:
  py::object owner_;
};

}  // namespace

std::shared_ptr<InterHost> make_py_inter_host(py::object impl) {
  py::object native = py::getattr(impl, "native", py::none());
  if (native.is_none()) return std::make_shared<PyInterHost>(std::move(impl));
  py::dict d = native.cast<py::dict>();
  NativeMPIConfig cfg;
  cfg.library = d["library"].cast<std::string>();
  cfg.family = d["family"].cast<std::string>();
  cfg.world = d["world"].cast<uintptr_t>();
  cfg.cross = d["cross"].cast<uintptr_t>();
  cfg.oob = d["oob"].cast<uintptr_t>();
  cfg.rank = d["rank"].cast<int>();
  cfg.size = d["size"].cast<int>();
  cfg.cross_rank = d["cross_rank"].cast<int>();
  cfg.cross_size = d["cross_size"].cast<int>();
  cfg.spin_us = d["spin_us"].cast<double>();
  cfg.small_bytes = d["small_bytes"].cast<size_t>();
  return std::make_shared<OwnedNativeMPI>(cfg, std::move(impl));
}

}  // namespace bindings
}  // namespace fastxfer
