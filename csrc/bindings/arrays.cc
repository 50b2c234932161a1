#include "bindings/arrays.h"

namespace fastxfer {
namespace bindings {

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

}  // namespace bindings
}  // namespace fastxfer
