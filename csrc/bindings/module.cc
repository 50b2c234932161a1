// fastxfer._core: the pybind11 module. It binds; it holds no logic. One file per area (kernels.cc,
// fusion.cc, engine.cc, topology.cc, data.cc, pool.cc); this one maps the core's error types to
// fastxfer's Python exceptions and applies the environment's settings (SIMD level, pool cap) at import.
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "bindings/arrays.h"
#include "bindings/pool.h"
#include "common/errors.h"
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

  // FASTXFER_SIMD=<level> forces a lower kernel path, FASTXFER_OUTPUT_POOL_MB caps the output
  // pool; a bad value fails the import.
  try {
    init_simd_level_from_env();
    init_pool_from_env();
  } catch (const std::invalid_argument& e) {
    throw py::import_error(e.what());
  }

  bindings::bind_kernels(m);
  bindings::bind_fusion(m);
  bindings::bind_engine(m);
  bindings::bind_c_api(m);
  bindings::bind_topology(m);
  bindings::bind_data(m);
  bindings::bind_pool(m);
}
