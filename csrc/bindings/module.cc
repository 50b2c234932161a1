// fastxfer._core: the pybind11 module. Thin by design: argument checks, GIL release, and calls
// into csrc/. No logic lives here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "common/dtype.h"
#include "common/parallel.h"
#include "compress/compress.h"
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

size_t size_of(const py::array& a) { return static_cast<size_t>(a.size()); }

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "fastxfer native core: SIMD bf16/fp16 kernels, fused gradient buckets";
  m.attr("__version__") = FASTXFER_VERSION;

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
}
