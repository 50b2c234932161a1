// fastxfer._core: the compression kernels (float32 <-> bf16/fp16, fused accumulate and sums), the
// SIMD level they run at, and the CPU features behind that choice.
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "bindings/arrays.h"
#include "common/cpu_features.h"
#include "common/parallel.h"
#include "kernels/compress.h"
#include "kernels/reduce.h"

namespace fastxfer {
namespace bindings {

namespace {

const char* wire_name(Compression c) { return c == Compression::kBF16 ? "bfloat16" : "float16"; }

Compression wire16(const std::string& name) {
  Compression c = compression_from_name(name);
  if (c == Compression::kNone) throw py::value_error("compression must be 'bf16' or 'fp16' here, not 'none'");
  return c;
}

}  // namespace

void bind_kernels(py::module_& m) {
  m.def(
      "_reduce_block",
      [](const std::string& op, const std::vector<py::array>& srcs, py::array out, double scale) {
        if (srcs.empty()) throw py::value_error("need at least one source");
        const std::string dt = dtype_str(srcs[0]);
        const size_t n = size_of(srcs[0]);
        std::vector<const void*> ptrs;
        for (const auto& a : srcs) ptrs.push_back(checked_data(a, "source", dt, n, false));
        void* dst = checked_data(out, "out", dt, n, true);
        ReduceOp rop = op_from_name(op);
        DType dtype = dtype_from_name(dt);
        py::gil_scoped_release nogil;
        reduce_block(rop, dtype, ptrs.data(), static_cast<int>(ptrs.size()), dst, n, scale);
      },
      py::arg("op"), py::arg("srcs"), py::arg("out"), py::arg("scale") = 1.0,
      "The engine's reduce kernel (kernels/reduce.h) on equal-sized arrays, in list (rank) order: tests.");
  m.def("simd_level", [] { return std::string(simd_level_name(active_simd_level())); });
  m.def("supported_simd_levels", [] {
    std::vector<std::string> out;
    for (SimdLevel l : supported_simd_levels()) out.emplace_back(simd_level_name(l));
    return out;
  });
  m.def("_set_simd_level", [](const std::string& name) { set_simd_level(simd_level_from_name(name)); },
        py::arg("level"));
  py::class_<CpuFeatures>(m, "CpuFeatures", "What cpuid and XCR0 say this CPU (and OS) supports.")
      .def_readonly("avx2", &CpuFeatures::avx2)
      .def_readonly("f16c", &CpuFeatures::f16c)
      .def_readonly("fma", &CpuFeatures::fma)
      .def_readonly("avx512f", &CpuFeatures::avx512f)
      .def_readonly("avx512bw", &CpuFeatures::avx512bw)
      .def_readonly("avx512vl", &CpuFeatures::avx512vl)
      .def_readonly("avx512dq", &CpuFeatures::avx512dq)
      .def_readonly("avx512_bf16", &CpuFeatures::avx512_bf16)
      .def_readonly("avx512_fp16", &CpuFeatures::avx512_fp16)
      .def_readonly("amx_bf16", &CpuFeatures::amx_bf16)
      .def_readonly("amx_tile", &CpuFeatures::amx_tile);
  m.def("cpu_features", &cpu_features, py::return_value_policy::reference);
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
}

}  // namespace bindings
}  // namespace fastxfer
