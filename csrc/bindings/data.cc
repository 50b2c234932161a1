// fastxfer._core: the input pipeline — tiled JPEGs, the batch ROI decoder, and the resampler.
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "bindings/arrays.h"
#include "data/jpeg.h"
#include "data/jpeg_tiles.h"
#include "data/resample.h"

namespace fastxfer {
namespace bindings {

namespace {

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
}

}  // namespace

void bind_data(py::module_& m) {
  py::class_<data::TileLayout>(m, "TileLayout", "The MCU grid of a tiled JPEG.")
      .def_readonly("height", &data::TileLayout::height)
      .def_readonly("width", &data::TileLayout::width)
      .def_readonly("mcu_h", &data::TileLayout::mcu_h)
      .def_readonly("mcu_w", &data::TileLayout::mcu_w)
      .def_readonly("rows", &data::TileLayout::rows)
      .def_readonly("cols", &data::TileLayout::cols)
      .def_readonly("subsampled", &data::TileLayout::subsampled);
  m.def("jpeg_support", [] { return py::make_tuple(data::jpeg_support_built(), data::jpeg_support_note()); },
        "(built, note): whether this build has the ROI JPEG decoder, and why not.");
  m.def(
      "jpeg_tile_layout",
      [](py::object data) -> py::object {
        py::buffer_info v = contiguous_bytes(data, "data");
        data::TileLayout t;
        if (!data::parse_tile_layout(static_cast<const uint8_t*>(v.ptr), static_cast<size_t>(v.size * v.itemsize), &t))
          return py::none();
        return py::cast(t);
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
        if (img.ndim() != 3) throw py::value_error("img must be H x W x C with C = 1, 3 or 4");
        const int H = static_cast<int>(img.shape(0)), W = static_cast<int>(img.shape(1));
        const int C = static_cast<int>(img.shape(2));
        auto* p = static_cast<const uint8_t*>(checked_data(img, "img", "uint8", size_of(img), false));
        if (out.ndim() != 3 || out.shape(2) != 3) throw py::value_error("out must be oh x ow x 3");
        const int oh = static_cast<int>(out.shape(0)), ow = static_cast<int>(out.shape(1));
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
        data::resize_image(p, H, W, C, y0, x0, ch, cw, oh, ow, aug, m, s, o, type);
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
}

}  // namespace bindings
}  // namespace fastxfer
