// fastxfer._core: the pybind11 module. It binds; it holds no logic. One file per area (kernels.cc,
// fusion.cc, engine.cc, topology.cc, data.cc, pool.cc); this one maps the core's error types to
// fastxfer's Python exceptions and binds `configure`, through which fastxfer/__init__.py hands the
// process-wide settings (SIMD level, kernel threads, output pool cap) to the core at import: the
// core reads no environment variable (fastxfer/settings.py reads them all).
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "bindings/arrays.h"
#include "common/errors.h"
#include "common/log.h"
#include "common/output_pool.h"
#include "common/parallel.h"
#include "kernels/compress.h"
#include "topology/topology.h"

namespace py = pybind11;
using namespace fastxfer;

namespace {

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

  m.def("set_log_level", &fastxfer::set_log_level, py::arg("level"),
        "The level (Python's numbers) below which the native core's own messages are dropped: the `fastxfer` "
        "logger's (fastxfer/log.py).");
  m.def("log_level", &fastxfer::log_level, "The native core's message level (set_log_level).");
  m.def(
      "configure",
      [](const std::string& simd_level, int threads, size_t output_pool_cap_bytes) {
        set_simd_level(simd_level.empty() ? best_simd_level() : simd_level_from_name(simd_level));
        set_default_threads(threads);
        pool_set_cap(output_pool_cap_bytes);
      },
      py::arg("simd_level"), py::arg("threads"), py::arg("output_pool_cap_bytes"),
      "The process-wide settings: the kernel path (\"\": the best this CPU supports; ValueError for one it "
      "cannot run), the kernels' default thread count (0: the CPUs of the affinity mask) and the output "
      "pool's cap in bytes. fastxfer/__init__.py calls it at import with fastxfer.settings' values.");

  bindings::bind_kernels(m);
  bindings::bind_fusion(m);
  bindings::bind_engine(m);
  bindings::bind_c_api(m);
  bindings::bind_topology(m);
  bindings::bind_data(m);
  bindings::bind_pool(m);
}
