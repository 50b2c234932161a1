// fastxfer._core: the fusion layer — BucketPlanner, Bucket, and one-pass pack/unpack.
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings/arrays.h"
#include "fusion/bucket_planner.h"
#include "fusion/pack.h"

namespace fastxfer {
namespace bindings {

void bind_fusion(py::module_& m) {
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

}  // namespace bindings
}  // namespace fastxfer
