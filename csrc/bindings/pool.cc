// fastxfer._core: the output pool (common/output_pool.h) bound for Python: pool_empty hands out
// numpy arrays whose memory comes from the pool and goes back to it when the array (and every
// view of it) is gone; the pool's statistics, cap and trim.
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "bindings/arrays.h"
#include "common/output_pool.h"

namespace fastxfer {

namespace bindings {

void bind_pool(py::module_& m) {
  m.def(
      "pool_empty",
      [](const std::vector<py::ssize_t>& shape, const py::dtype& dtype) {
        size_t n = static_cast<size_t>(dtype.itemsize());
        for (py::ssize_t d : shape) {
          if (d < 0) throw py::value_error("negative dimension");
          if (d != 0 && n > SIZE_MAX / static_cast<size_t>(d)) throw py::value_error("array too large");
          n *= static_cast<size_t>(d);
        }
        void* p = pool_acquire(n);
        py::capsule owner;
        try {
          owner = py::capsule(p, [](void* q) { pool_release(q, 0); });
        } catch (...) {
          pool_release(p, n);
          throw;
        }
        return py::array(dtype, shape, p, owner);
      },
      py::arg("shape"), py::arg("dtype"),
      "An uninitialised, writable, C-contiguous array whose memory comes from the output pool and "
      "returns to it when the array and all its views are gone (array.base holds it).");
  m.def("output_pool_stats", [] {
    PoolStats s = pool_stats();
    py::dict d;
    d["cap_bytes"] = s.cap_bytes;
    d["cached_bytes"] = s.cached_bytes;
    d["cached_buffers"] = s.cached_buffers;
    d["live_bytes"] = s.live_bytes;
    d["live_buffers"] = s.live_buffers;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["evictions"] = s.evictions;
    d["bad_releases"] = s.bad_releases;
    return d;
  });
  m.def("set_output_pool_cap", &pool_set_cap, py::arg("bytes"),
        "Cap the bytes the output pool keeps cached (0: cache nothing); evicts down to it now.");
  m.def("output_pool_trim", &pool_trim, "Unmap every cached output buffer (live arrays are untouched).");
}

}  // namespace bindings
}  // namespace fastxfer
