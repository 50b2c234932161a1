// fastxfer._core: the pybind11 module. Thin by design: argument checks, GIL release, and calls
// into csrc/. No logic lives here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>

#include "common/dtype.h"
#include "engine/collective.h"
#include "engine/engine.h"
#include "topology/topology.h"
#include "transport/hierarchical.h"
#include "transport/shm/shm_transport.h"
#include "common/parallel.h"
#include "compress/compress.h"
#include "data/jpeg.h"
#include "data/jpeg_tiles.h"
#include "data/resample.h"
#include "compress/cpu_features.h"
#include "fusion/bucket_planner.h"
#include "fusion/pack.h"

namespace py = pybind11;
using namespace fastxfer;

namespace {

std::string dtype_str(const py::array& a) { return py::str(a.dtype().attr("name")); }

// Checks one array argument and returns its data pointer. Errors name the argument and the problem:
// TypeError for a wrong type/dtype, ValueError for layout, size or writability.
void* checked_data(const py::handle& obj, const char* what, const std::string& want_dtype, size_t want_size,
                   bool writable) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(std::string(what) + " must be a numpy array, not " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  py::array a = py::reinterpret_borrow<py::array>(obj);
  std::string dt = dtype_str(a);
  if (dt != want_dtype) throw py::type_error(std::string(what) + " must have dtype " + want_dtype + ", not " + dt);
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(std::string(what) + " must be C-contiguous (use numpy.ascontiguousarray)");
  if (static_cast<size_t>(a.size()) != want_size)
    throw py::value_error(std::string(what) + " has " + std::to_string(a.size()) + " elements, expected " +
                          std::to_string(want_size));
  if (writable) {
    if (!a.writeable()) throw py::value_error(std::string(what) + " is read-only");
    return a.mutable_data();
  }
  return const_cast<void*>(a.data());
}

const char* wire_name(Compression c) { return c == Compression::kBF16 ? "bfloat16" : "float16"; }

Compression wire16(const std::string& name) {
  Compression c = compression_from_name(name);
  if (c == Compression::kNone) throw py::value_error("compression must be 'bf16' or 'fp16' here, not 'none'");
  return c;
}

// The bytes of a buffer-protocol object (bytes, bytearray, memoryview, numpy array), which must
// be C-contiguous: a strided view would be read as if it were not.
py::buffer_info contiguous_bytes(const py::handle& obj, const std::string& what) {
  if (!PyObject_CheckBuffer(obj.ptr()))
    throw py::type_error(what + " is a " + std::string(py::str(py::type::of(obj).attr("__name__"))) +
                         ", not bytes-like");
  py::buffer_info v = py::reinterpret_borrow<py::buffer>(obj).request();
  ssize_t stride = v.itemsize;
  for (ssize_t d = v.ndim - 1; d >= 0; --d) {
    if (v.shape[d] > 1 && v.strides[d] != stride)
      throw py::value_error(what + " is not contiguous (pass bytes(...) or a contiguous copy)");
    stride *= v.shape[d];
  }
  return v;
}

// The output of the image kernels: a C-contiguous float32 or bfloat16 (ml_dtypes; uint16 bits
// accepted too) array of `want` elements.
void* image_out(const py::handle& obj, size_t want, data::OutType* type) {
  if (!py::isinstance<py::array>(obj)) throw py::type_error("out must be a numpy array");
  std::string dt = dtype_str(py::reinterpret_borrow<py::array>(obj));
  if (dt == "float32") {
    *type = data::OutType::kFloat32;
    return checked_data(obj, "out", "float32", want, true);
  }
  if (dt == "bfloat16" || dt == "uint16") {
    *type = data::OutType::kBFloat16;
    return checked_data(obj, "out", dt, want, true);
  }
  throw py::type_error("out must have dtype float32 or bfloat16, not " + dt);
}

void read_mean_std(const py::array& mean, const py::array& std_, float m[3], float s[3]) {
  std::memcpy(m, checked_data(mean, "mean", "float32", 3, false), 3 * sizeof(float));
  std::memcpy(s, checked_data(std_, "std", "float32", 3, false), 3 * sizeof(float));
  for (int c = 0; c < 3; ++c)
    if (!(s[c] != 0.0f)) throw py::value_error("std must be non-zero in every channel");
}

size_t size_of(const py::array& a) { return static_cast<size_t>(a.size()); }

std::vector<int64_t> shape_of(const py::array& a) {
  std::vector<int64_t> s;
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s.push_back(static_cast<int64_t>(a.shape(i)));
  return s;
}

CollectiveKind kind_from_name(const std::string& k) {
  for (auto c : {CollectiveKind::kAllreduce, CollectiveKind::kBroadcast, CollectiveKind::kAllgather,
                 CollectiveKind::kBarrier})
    if (k == kind_name(c)) return c;
  throw py::value_error("unknown collective '" + k + "'");
}

// InterHost implemented by a Python object (fastxfer.mpi_transport.MPIInterHost, on mpi4py).
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
  int64_t min_all(int64_t v) override {
    py::gil_scoped_acquire gil;
    return impl_.attr("min_all")(v).cast<int64_t>();
  }
  std::vector<uint64_t> allgather_u64(uint64_t v) override {
    py::gil_scoped_acquire gil;
    return impl_.attr("allgather_u64")(v).cast<std::vector<uint64_t>>();
  }
  std::vector<std::vector<char>> allgather_bytes(const std::vector<char>& mine) override {
    py::gil_scoped_acquire gil;
    py::list got = impl_.attr("allgather_bytes")(py::bytes(mine.data(), mine.size()));
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
    py::capsule keep(p, [](void*) {});  // the transport owns the memory; the view must not outlive the call
    return py::array(py::dtype("uint8"), {static_cast<py::ssize_t>(nbytes)}, {1}, static_cast<uint8_t*>(p), keep);
  }
  py::object impl_;
  int rank_ = 0, size_ = 1;
};

void raise_as(const char* cls, const char* what) {
  py::object t = py::module_::import("fastxfer.errors").attr(cls);
  PyErr_SetString(t.ptr(), what);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "fastxfer native core: SIMD bf16/fp16 kernels, fused gradient buckets";
  m.attr("__version__") = FASTXFER_VERSION;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const PeerFailure& e) {
      raise_as("PeerFailureError", e.what());
    } catch (const Mismatch& e) {
      raise_as("MismatchError", e.what());
    } catch (const EngineError& e) {
      raise_as("FastxferError", e.what());
    } catch (const TopologyError& e) {
      raise_as("TopologyError", e.what());
    }
  });

  try {
    init_simd_level_from_env();
  } catch (const std::invalid_argument& e) {
    throw py::import_error(e.what());
  }

  m.def("simd_level", [] { return std::string(simd_level_name(active_simd_level())); });
  m.def("supported_simd_levels", [] {
    std::vector<std::string> out;
    for (SimdLevel l : supported_simd_levels()) out.emplace_back(simd_level_name(l));
    return out;
  });
  m.def("_set_simd_level", [](const std::string& name) { set_simd_level(simd_level_from_name(name)); },
        py::arg("level"));
  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["avx2"] = f.avx2;
    d["f16c"] = f.f16c;
    d["fma"] = f.fma;
    d["avx512f"] = f.avx512f;
    d["avx512bw"] = f.avx512bw;
    d["avx512vl"] = f.avx512vl;
    d["avx512dq"] = f.avx512dq;
    d["avx512_bf16"] = f.avx512_bf16;
    d["avx512_fp16"] = f.avx512_fp16;
    d["amx_bf16"] = f.amx_bf16;
    d["amx_tile"] = f.amx_tile;
    return d;
  });
  m.def("default_threads", &default_threads);
  m.def(
      "_set_stream_stores",
      [](bool on) {
        static thread_local std::unique_ptr<ScopedStreamStores> scope;
        scope.reset();
        if (on) scope = std::make_unique<ScopedStreamStores>(true);
      },
      py::arg("on"), "Testing hook: non-temporal float32 stores in the kernels on the calling thread.");
  m.def("_set_thread_flush_denormals", &set_thread_flush_denormals, py::arg("on"),
        "Testing hook: set FTZ+DAZ on the calling thread (as TensorFlow's threads do); returns the old state.");

  m.def(
      "compress_into",
      [](py::array src, py::array dst, const std::string& compression, float scale, int threads) {
        Compression c = wire16(compression);
        size_t n = size_of(src);
        auto* s = static_cast<const float*>(checked_data(src, "input", "float32", n, false));
        auto* d = static_cast<uint16_t*>(checked_data(dst, "out", wire_name(c), n, true));
        py::gil_scoped_release nogil;
        compress(c, s, d, n, scale, threads);
      },
      py::arg("src"), py::arg("dst"), py::arg("compression"), py::arg("scale") = 1.0f, py::arg("threads") = 0);
  m.def(
      "decompress_into",
      [](py::array src, py::array dst, const std::string& compression, float scale, int threads) {
        Compression c = wire16(compression);
        size_t n = size_of(src);
        auto* s = static_cast<const uint16_t*>(checked_data(src, "input", wire_name(c), n, false));
        auto* d = static_cast<float*>(checked_data(dst, "out", "float32", n, true));
        py::gil_scoped_release nogil;
        decompress(c, s, d, n, scale, threads);
      },
      py::arg("src"), py::arg("dst"), py::arg("compression"), py::arg("scale") = 1.0f, py::arg("threads") = 0);
  m.def(
      "accumulate",
      [](py::array acc, py::array src, const std::string& compression, int threads) {
        Compression c = wire16(compression);
        size_t n = size_of(acc);
        auto* a = static_cast<float*>(checked_data(acc, "acc", "float32", n, true));
        auto* s = static_cast<const uint16_t*>(checked_data(src, "src", wire_name(c), n, false));
        py::gil_scoped_release nogil;
        accumulate(c, a, s, n, threads);
      },
      py::arg("acc"), py::arg("src"), py::arg("compression"), py::arg("threads") = 0,
      "acc += decompress(src), in float32");
  m.def(
      "sum_compress",
      [](py::array a, py::array b, py::array dst, const std::string& compression, int threads) {
        Compression c = wire16(compression);
        size_t n = size_of(a);
        auto* pa = static_cast<const uint16_t*>(checked_data(a, "a", wire_name(c), n, false));
        auto* pb = static_cast<const uint16_t*>(checked_data(b, "b", wire_name(c), n, false));
        auto* pd = static_cast<uint16_t*>(checked_data(dst, "out", wire_name(c), n, true));
        py::gil_scoped_release nogil;
        sum_compress(c, pa, pb, pd, n, threads);
      },
      py::arg("a"), py::arg("b"), py::arg("out"), py::arg("compression"), py::arg("threads") = 0,
      "out = compress(decompress(a) + decompress(b))");

  py::class_<Bucket>(m, "Bucket", "A fused bucket planned by BucketPlanner (read-only).")
      .def_property_readonly("dtype", [](const Bucket& b) { return std::string(dtype_name(b.dtype)); })
      .def_property_readonly("compression", [](const Bucket& b) { return std::string(compression_name(b.compression)); })
      .def_property_readonly("wire_dtype", [](const Bucket& b) { return std::string(dtype_name(b.wire_dtype)); })
      .def_readonly("tensors", &Bucket::tensors)
      .def_readonly("offsets", &Bucket::offsets)
      .def_readonly("numels", &Bucket::numels)
      .def_readonly("numel", &Bucket::numel)
      .def_property_readonly("nbytes", &Bucket::nbytes)
      .def("__repr__", [](const Bucket& b) {
        return "<Bucket " + std::string(dtype_name(b.dtype)) + "->" + dtype_name(b.wire_dtype) + " tensors=" +
               std::to_string(b.tensors.size()) + " nbytes=" + std::to_string(b.nbytes()) + ">";
      });

  py::class_<BucketPlanner>(m, "BucketPlanner")
      .def(py::init([](size_t cap_bytes, size_t first_cap_bytes, const std::string& compression) {
             return BucketPlanner(cap_bytes, first_cap_bytes, compression_from_name(compression));
           }),
           py::arg("cap_bytes") = kDefaultBucketCapBytes, py::arg("first_cap_bytes") = kDefaultFirstBucketCapBytes,
           py::arg("compression") = "none")
      .def_property_readonly("cap_bytes", &BucketPlanner::cap_bytes)
      .def_property_readonly("first_cap_bytes", &BucketPlanner::first_cap_bytes)
      .def_property_readonly("compression",
                             [](const BucketPlanner& p) { return std::string(compression_name(p.compression())); })
      .def(
          "plan",
          [](const BucketPlanner& p, const std::vector<std::pair<long long, std::string>>& specs) {
            std::vector<TensorSpec> ts;
            ts.reserve(specs.size());
            for (size_t i = 0; i < specs.size(); ++i) {
              if (specs[i].first < 0)
                throw py::value_error("tensor " + std::to_string(i) + " has a negative element count");
              ts.push_back({static_cast<size_t>(specs[i].first), dtype_from_name(specs[i].second)});
            }
            return p.plan(ts);
          },
          py::arg("specs"), "specs: list of (numel, dtype name) in gradient-ready order");

  m.def(
      "pack",
      [](const Bucket& b, const py::sequence& tensors, py::array out, double scale, int threads) {
        if (static_cast<size_t>(py::len(tensors)) != b.tensors.size())
          throw py::value_error("pack: got " + std::to_string(py::len(tensors)) + " tensors for a bucket of " +
                                std::to_string(b.tensors.size()));
        std::vector<const void*> srcs;
        for (size_t j = 0; j < b.tensors.size(); ++j) {
          std::string what = "tensor " + std::to_string(j);
          srcs.push_back(checked_data(tensors[j], what.c_str(), dtype_name(b.dtype), b.numels[j], false));
        }
        if (!(out.flags() & py::array::c_style)) throw py::value_error("out must be C-contiguous");
        if (static_cast<size_t>(out.nbytes()) < b.nbytes())
          throw py::value_error("out holds " + std::to_string(out.nbytes()) + " bytes, the bucket needs " +
                                std::to_string(b.nbytes()));
        if (!out.writeable()) throw py::value_error("out is read-only");
        void* dst = out.mutable_data();
        py::gil_scoped_release nogil;
        pack(b, srcs, dst, scale, threads);
      },
      py::arg("bucket"), py::arg("tensors"), py::arg("out"), py::arg("scale") = 1.0, py::arg("threads") = 0);
  m.def(
      "unpack",
      [](const Bucket& b, py::array buf, const py::sequence& outs, double scale, int threads) {
        if (static_cast<size_t>(py::len(outs)) != b.tensors.size())
          throw py::value_error("unpack: got " + std::to_string(py::len(outs)) + " outputs for a bucket of " +
                                std::to_string(b.tensors.size()));
        if (!(buf.flags() & py::array::c_style)) throw py::value_error("buffer must be C-contiguous");
        if (static_cast<size_t>(buf.nbytes()) < b.nbytes())
          throw py::value_error("buffer holds " + std::to_string(buf.nbytes()) + " bytes, the bucket needs " +
                                std::to_string(b.nbytes()));
        std::vector<void*> dsts;
        for (size_t j = 0; j < b.tensors.size(); ++j) {
          std::string what = "output " + std::to_string(j);
          dsts.push_back(checked_data(outs[j], what.c_str(), dtype_name(b.dtype), b.numels[j], true));
        }
        const void* src = buf.data();
        py::gil_scoped_release nogil;
        unpack(b, src, dsts, scale, threads);
      },
      py::arg("bucket"), py::arg("buffer"), py::arg("outs"), py::arg("scale") = 1.0, py::arg("threads") = 0);

  py::class_<Engine>(m, "Engine", "The background collective engine over shared memory (one per process).")
      .def(py::init([](const std::string& name, int rank, int size, size_t window_bytes, size_t oob_bytes,
                       double timeout_s, double attach_timeout_s, int threads, std::vector<int> cpus,
                       size_t bucket_cap_bytes, int max_records, size_t stream_min_bytes, py::object inter_host) {
             ShmConfig c;
             c.name = name;
             c.rank = rank;
             c.size = size;
             c.window_bytes = window_bytes;
             c.oob_bytes = oob_bytes;
             c.timeout_s = timeout_s;
             c.attach_timeout_s = attach_timeout_s;
             c.threads = threads;
             c.max_records = max_records;
             c.stream_min_bytes = stream_min_bytes;
             EngineConfig e;
             e.bucket_cap_bytes = bucket_cap_bytes;
             e.max_records = max_records;
             e.cpus = std::move(cpus);
             std::shared_ptr<InterHost> inter;
             if (!inter_host.is_none()) inter = std::make_shared<PyInterHost>(inter_host);
             py::gil_scoped_release nogil;  // waits for the other ranks to attach
             auto local = std::make_unique<ShmTransport>(c);
             if (inter) return std::make_unique<Engine>(std::make_unique<HierarchicalTransport>(std::move(local), inter), e);
             return std::make_unique<Engine>(std::move(local), e);
           }),
           py::arg("name"), py::arg("rank"), py::arg("size"), py::arg("window_bytes"), py::arg("oob_bytes"),
           py::arg("timeout_s"), py::arg("attach_timeout_s"), py::arg("threads"), py::arg("cpus"),
           py::arg("bucket_cap_bytes"), py::arg("max_records"), py::arg("stream_min_bytes"),
           py::arg("inter_host") = py::none())
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("size", &Engine::size)
      .def_property_readonly("oob_capacity", &Engine::oob_capacity)
      .def_property_readonly("running", &Engine::running)
      .def(
          "submit",
          [](Engine& eng, const std::string& kind, const std::string& name, py::object input, py::object output,
             const std::string& op, const std::string& compression, int root, double prescale, double postscale,
             int64_t bucket_cap) {
            Request r;
            r.kind = kind_from_name(kind);
            r.op = op_from_name(op);
            r.compression = compression_from_name(compression);
            r.root = root;
            r.prescale = prescale;
            r.postscale = postscale;
            std::vector<int64_t> shape;
            if (!input.is_none()) {
              py::array in = input.cast<py::array>();
              r.dtype = dtype_from_name(dtype_str(in));
              r.numel = size_of(in);
              shape = shape_of(in);
              r.in = checked_data(in, "input", dtype_str(in), r.numel, false);
            }
            if (!output.is_none()) {
              py::array out = output.cast<py::array>();
              r.out = checked_data(out, "output", dtype_name(r.dtype), r.numel, true);
            }
            if (r.compression != Compression::kNone && r.dtype != DType::kFloat32)
              throw py::value_error(std::string("compression applies to float32 tensors, not ") + dtype_name(r.dtype));
            if (bucket_cap < 0) throw py::value_error("bucket_cap must be >= 0 bytes");
            r.rec = make_record(r.kind, name, r.dtype, shape, r.op, r.compression, root, prescale, postscale);
            r.rec.bucket_cap = bucket_cap;
            return eng.submit(std::move(r));
          },
          py::arg("kind"), py::arg("name"), py::arg("input"), py::arg("output"), py::arg("op") = "sum",
          py::arg("compression") = "none", py::arg("root") = 0, py::arg("prescale") = 1.0,
          py::arg("postscale") = 1.0, py::arg("bucket_cap") = 0)
      .def("wait", &Engine::wait, py::arg("id"), py::call_guard<py::gil_scoped_release>())
      .def("done", &Engine::done, py::arg("id"))
      .def("release", &Engine::release, py::arg("id"))
      .def("take_finished", &Engine::take_finished)
      .def(
          "take_gathered",
          [](Engine& eng, uint64_t id) {
            int64_t rows = 0;
            auto* vec = new std::vector<char>(eng.take_gathered(id, &rows));
            py::capsule owner(vec, [](void* p) { delete static_cast<std::vector<char>*>(p); });
            py::array_t<uint8_t> bytes({static_cast<py::ssize_t>(vec->size())}, {1},
                                       reinterpret_cast<uint8_t*>(vec->data()), owner);
            return py::make_tuple(bytes, rows);
          },
          py::arg("id"))
      .def(
          "oob_allreduce",
          [](Engine& eng, py::array in, py::array out, const std::string& name, const std::string& op,
             double postscale) {
            DType dt = dtype_from_name(dtype_str(in));
            size_t n = size_of(in);
            const void* src = checked_data(in, "input", dtype_str(in), n, false);
            void* dst = checked_data(out, "output", dtype_name(dt), n, true);
            ReduceOp rop = op_from_name(op);
            Record rec = make_record(CollectiveKind::kAllreduce, name, dt, shape_of(in), rop, Compression::kNone, 0,
                                     1.0, postscale);
            py::gil_scoped_release nogil;
            eng.oob_allreduce(rec, src, dst, n, dt, rop, postscale);
          },
          py::arg("input"), py::arg("output"), py::arg("name"), py::arg("op"), py::arg("postscale"))
      .def("stats",
           [](const Engine& eng) {
             TransportStats s = eng.stats();
             py::dict d;
             d["pack_s"] = s.pack;
             d["wait_s"] = s.wait;
             d["reduce_s"] = s.reduce;
             d["unpack_s"] = s.unpack;
             d["negotiate_s"] = s.negotiate;
             d["chunks"] = s.chunks;
             d["rounds"] = s.rounds;
             d["wire_bytes"] = s.bytes;
             return d;
           })
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>());

  // ---- topology ----
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
  // ---- input pipeline ----
  m.def("jpeg_support", [] { return py::make_tuple(data::jpeg_support_built(), data::jpeg_support_note()); },
        "(built, note): whether this build has the ROI JPEG decoder, and why not.");
  m.def(
      "jpeg_tile_layout",
      [](py::object data) -> py::object {
        py::buffer_info v = contiguous_bytes(data, "data");
        data::TileLayout t;
        if (!data::parse_tile_layout(static_cast<const uint8_t*>(v.ptr), static_cast<size_t>(v.size * v.itemsize), &t))
          return py::none();
        py::dict d;
        d["height"] = t.height;
        d["width"] = t.width;
        d["mcu_h"] = t.mcu_h;
        d["mcu_w"] = t.mcu_w;
        d["rows"] = t.rows;
        d["cols"] = t.cols;
        d["subsampled"] = t.subsampled;
        return d;
      },
      py::arg("data"), "The MCU grid of a tiled JPEG (restart marker after every MCU), or None for any other data.");
  m.def(
      "jpeg_tile_crop",
      [](py::object data, int r0, int r1, int c0, int c1) -> py::bytes {
        py::buffer_info v = contiguous_bytes(data, "data");
        data::TileLayout t;
        const auto* p = static_cast<const uint8_t*>(v.ptr);
        if (!data::parse_tile_layout(p, static_cast<size_t>(v.size * v.itemsize), &t))
          throw py::value_error("not a tiled JPEG (baseline, one scan, a restart marker after every MCU)");
        if (!(0 <= r0 && r0 < r1 && r1 <= t.rows && 0 <= c0 && c0 < c1 && c1 <= t.cols))
          throw py::value_error("MCU range outside the " + std::to_string(t.rows) + "x" + std::to_string(t.cols) +
                                " grid");
        std::vector<uint8_t> out;
        data::build_tile_jpeg(p, t, r0, r1, c0, c1, &out);
        return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
      },
      py::arg("data"), py::arg("r0"), py::arg("r1"), py::arg("c0"), py::arg("c1"),
      "The JPEG of MCU rows [r0, r1) and columns [c0, c1) of a tiled JPEG.");
  m.def(
      "resize_normalize",
      [](py::array img, int y0, int x0, int ch, int cw, py::array out, bool flip, float brightness, float contrast,
         float saturation, py::array mean, py::array std_) {
        if (img.ndim() != 3 || !(img.shape(2) == 1 || img.shape(2) == 3 || img.shape(2) == 4))
          throw py::value_error("img must be H x W x C with C = 1, 3 or 4");
        const int H = static_cast<int>(img.shape(0)), W = static_cast<int>(img.shape(1));
        const int C = static_cast<int>(img.shape(2));
        auto* p = static_cast<const uint8_t*>(checked_data(img, "img", "uint8", size_of(img), false));
        if (out.ndim() != 3 || out.shape(2) != 3) throw py::value_error("out must be oh x ow x 3");
        const int oh = static_cast<int>(out.shape(0)), ow = static_cast<int>(out.shape(1));
        if (oh < 1 || ow < 1) throw py::value_error("out must not be empty");
        if (ch < 1 || cw < 1 || y0 < 0 || x0 < 0 || y0 > H - ch || x0 > W - cw)
          throw py::value_error("crop box (y0=" + std::to_string(y0) + ", x0=" + std::to_string(x0) + ", h=" +
                                std::to_string(ch) + ", w=" + std::to_string(cw) + ") is not inside the " +
                                std::to_string(H) + "x" + std::to_string(W) + " image");
        data::OutType type;
        void* o = image_out(out, size_of(out), &type);
        float m[3], s[3];
        read_mean_std(mean, std_, m, s);
        data::Augment aug;
        aug.flip = flip;
        aug.brightness = brightness;
        aug.contrast = contrast;
        aug.saturation = saturation;
        py::gil_scoped_release nogil;
        data::U8Rows rows(p, W, C, x0, cw);
        data::Resampler r;
        r.run(rows, y0, x0, ch, cw, oh, ow, aug, m, s, o, type);
      },
      py::arg("img"), py::arg("y0"), py::arg("x0"), py::arg("ch"), py::arg("cw"), py::arg("out"), py::arg("flip"),
      py::arg("brightness"), py::arg("contrast"), py::arg("saturation"), py::arg("mean"), py::arg("std"),
      "The native crop + resize + flip + jitter + normalise of one uint8 image into out (float32 or bfloat16).");
  py::class_<data::BatchDecoder>(m, "JpegBatchDecoder",
                                 "Region-of-interest JPEG decode fused with crop/resize/normalise, on its own threads.")
      .def(py::init<const std::string&, int, int64_t>(), py::arg("library_path"), py::arg("threads") = 0,
           py::arg("max_pixels") = int64_t(1) << 28)
      .def_property_readonly("library_path", &data::BatchDecoder::library_path)
      .def_property_readonly("threads", &data::BatchDecoder::threads)
      .def(
          "transcode",
          [](data::BatchDecoder& d, py::object data) {
            py::buffer_info v = contiguous_bytes(data, "data");
            std::vector<uint8_t> out;
            {
              py::gil_scoped_release nogil;
              out = d.transcode(static_cast<const uint8_t*>(v.ptr), static_cast<size_t>(v.size * v.itemsize));
            }
            return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
          },
          py::arg("data"),
          "Lossless transcode of a JPEG to fastxfer's tiled form (a restart marker after every MCU); raises "
          "RuntimeError with libjpeg's reason when it cannot.")
      .def("set_decode_only", &data::BatchDecoder::set_decode_only, py::arg("on"),
           "Benchmark switch: decode the rows each crop needs and drop them (no resampling; out is not written).")
      .def("set_tiles", &data::BatchDecoder::set_tiles, py::arg("on"),
           "False decodes tiled records by region of interest, as untiled ones (for tests and benchmarks).")
      .def(
          "decode_batch",
          [](data::BatchDecoder& d, py::sequence records, py::array heights, py::array widths, py::array boxes,
             py::array flips, py::array jitter, py::array mean, py::array std_, py::array out) {
            const size_t n = static_cast<size_t>(py::len(records));
            auto* hs = static_cast<const int32_t*>(checked_data(heights, "heights", "int32", n, false));
            auto* ws = static_cast<const int32_t*>(checked_data(widths, "widths", "int32", n, false));
            auto* bx = static_cast<const int32_t*>(checked_data(boxes, "boxes", "int32", 4 * n, false));
            auto* fl = static_cast<const uint8_t*>(checked_data(flips, "flips", "uint8", n, false));
            auto* jt = static_cast<const float*>(checked_data(jitter, "jitter", "float32", 3 * n, false));
            if (out.ndim() != 4 || static_cast<size_t>(out.shape(0)) != n || out.shape(3) != 3)
              throw py::value_error("out must be N x H x W x 3 with N = len(records) = " + std::to_string(n));
            const int oh = static_cast<int>(out.shape(1)), ow = static_cast<int>(out.shape(2));
            if (oh < 1 || ow < 1) throw py::value_error("out must not be empty");
            data::OutType type;
            void* o = image_out(out, size_of(out), &type);
            float m[3], s[3];
            read_mean_std(mean, std_, m, s);
            std::vector<py::buffer_info> views;  // keep every record's buffer alive (and released with the GIL)
            views.reserve(n);
            std::vector<data::JpegImage> images(n);
            for (size_t i = 0; i < n; ++i) {
              views.push_back(contiguous_bytes(records[i], "record " + std::to_string(i)));
              const py::buffer_info& v = views.back();
              data::JpegImage& im = images[i];
              im.data = static_cast<const uint8_t*>(v.ptr);
              im.size = static_cast<size_t>(v.size * v.itemsize);
              im.height = hs[i];
              im.width = ws[i];
              im.y = bx[4 * i];
              im.x = bx[4 * i + 1];
              im.h = bx[4 * i + 2];
              im.w = bx[4 * i + 3];
              if (im.h < 1 || im.w < 1 || im.y < 0 || im.x < 0 || im.y > im.height - im.h ||
                  im.x > im.width - im.w)
                throw py::value_error("box of image " + std::to_string(i) + " is not inside its " +
                                      std::to_string(im.height) + "x" + std::to_string(im.width) + " image");
              im.aug.flip = fl[i] != 0;
              im.aug.brightness = jt[3 * i];
              im.aug.contrast = jt[3 * i + 1];
              im.aug.saturation = jt[3 * i + 2];
            }
            std::vector<std::string> errors;
            {
              py::gil_scoped_release nogil;
              errors = d.decode_batch(images, oh, ow, m, s, o, type);
            }
            return errors;
          },
          py::arg("records"), py::arg("heights"), py::arg("widths"), py::arg("boxes"), py::arg("flips"),
          py::arg("jitter"), py::arg("mean"), py::arg("std"), py::arg("out"),
          "Decodes records[i] cropped to boxes[i] (y, x, h, w) into out[i]; returns one message per image "
          "('' when it was written).");

  m.def("format_cpu_list", &format_cpu_list, py::arg("cpus"));
  m.def("parse_cpu_list", [](const std::string& s) { return parse_cpu_list(s, "argument"); }, py::arg("text"));
  m.def("bind_cpus", &bind_cpus, py::arg("cpus"));
  m.def("bind_memory", &bind_memory, py::arg("nodes"));
}
