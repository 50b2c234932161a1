// Reading buffers out of Python objects at the boundary. Not argument validation (that lives in
// fastxfer/_validate.py, once for every entry point): these checks only make sure the C++ core
// never reads or writes past a buffer it was handed, whoever calls the private module.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fastxfer {
namespace bindings {

namespace py = pybind11;

// numpy's name of the array's dtype ("float32", "bfloat16", ...). The built-in kinds are named
// from the descriptor's kind and size (numpy's dtype.name is Python code: ~3 us a call, and a
// submission asks several times); anything else (ml_dtypes' bfloat16, ...) asks numpy.
inline std::string dtype_str(const py::array& a) {
  py::dtype d = a.dtype();
  const char kind = d.kind();
  const py::ssize_t n = d.itemsize();
  if (kind == 'f' && (n == 2 || n == 4 || n == 8)) return "float" + std::to_string(8 * n);
  if (kind == 'i' && (n == 1 || n == 2 || n == 4 || n == 8)) return "int" + std::to_string(8 * n);
  if (kind == 'u' && (n == 1 || n == 2 || n == 4 || n == 8)) return "uint" + std::to_string(8 * n);
  if (kind == 'b' && n == 1) return "bool";
  return py::str(d.attr("name"));
}

inline size_t size_of(const py::array& a) { return static_cast<size_t>(a.size()); }

inline std::vector<int64_t> shape_of(const py::array& a) {
  std::vector<int64_t> s;
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s.push_back(static_cast<int64_t>(a.shape(i)));
  return s;
}

// The data pointer of a C-contiguous numpy array of `want_dtype` and `want_size` elements.
// TypeError for a wrong type/dtype, ValueError for layout, size or writability.
void* checked_data(const py::handle& obj, const char* what, const std::string& want_dtype, size_t want_size,
                   bool writable);

// The bytes of a buffer-protocol object (bytes, bytearray, memoryview, numpy array), which must
// be C-contiguous: a strided view would be read as if it were not.
py::buffer_info contiguous_bytes(const py::handle& obj, const std::string& what);

// One registration function per area, called by module.cc.
void bind_kernels(py::module_& m);
void bind_fusion(py::module_& m);
void bind_engine(py::module_& m);
void bind_c_api(py::module_& m);  // engine.cc: the C interface for the TensorFlow op library
void bind_topology(py::module_& m);
void bind_data(py::module_& m);
void bind_pool(py::module_& m);

}  // namespace bindings
}  // namespace fastxfer
