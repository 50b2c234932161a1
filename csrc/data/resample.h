// Crop + resize + flip + colour jitter + normalisation of one image into a batch slot: the
// native counterpart of fastxfer/data/decoders/numba_ref.py's Numba kernel, with the same filter (separable
// triangle, widened by the shrink factor: PIL's antialiased BILINEAR) and the same arithmetic up
// to float rounding order.
//
// The resampler is streaming: it asks a RowSource for input rows in non-decreasing order and keeps
// only the few rows one output row needs (a ring), so a JPEG decoder can feed it scanline by
// scanline and the crop never has to exist as a whole image. Pixels travel as 4 floats (RGB plus
// one unused lane) so the horizontal pass is one 4-wide multiply-add per tap.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace fastxfer {
namespace data {

// Filter taps from the input span [start, start+length) to out_len samples. For output o the taps
// are input indices first[o] .. first[o]+taps-1 with weights w[o*taps + k]; taps past an output's
// own count have weight 0 and repeat a valid index, so every output has exactly `taps` taps.
struct Taps {
  int out_len = 0;
  int taps = 0;
  std::vector<int32_t> first;  // first input index (absolute, not relative to start)
  std::vector<int32_t> count;  // taps with non-zero support
  std::vector<float> w;        // out_len * taps
};
void make_taps(int start, int length, int out_len, Taps* t);

// Per-image parameters (1.0 = unchanged for the jitter factors).
struct Augment {
  bool flip = false;
  float brightness = 1.0f, contrast = 1.0f, saturation = 1.0f;
};

enum class OutType { kFloat32, kBFloat16 };

// Supplies input rows as RGBX bytes (the fourth byte is ignored).
class RowSource {
 public:
  virtual ~RowSource() = default;
  // Bytes one row needs in the resampler's ring, and where (in pixels) column x0 of the crop
  // starts within it. Asked once per image, before the first read_row.
  virtual size_t slot_bytes() const = 0;
  virtual int slot_offset() const = 0;
  // Writes input row `row` (an absolute image row; calls come in increasing order) into slot.
  virtual void read_row(int row, uint8_t* slot) = 0;
};

// Rows of an 8-bit H x W x C image in memory (C = 1: grey, replicated; 3: RGB; 4: RGBX), for the
// crop's columns [x0, x0 + cw).
class U8Rows : public RowSource {
 public:
  U8Rows(const uint8_t* data, int width, int channels, int x0, int cw)
      : data_(data), width_(width), channels_(channels), x0_(x0), cw_(cw) {}
  size_t slot_bytes() const override { return static_cast<size_t>(cw_) * 4; }
  int slot_offset() const override { return 0; }
  void read_row(int row, uint8_t* slot) override;

 private:
  const uint8_t* data_;
  int width_, channels_, x0_, cw_;
};

// Whether the crop [y0, y0+ch) x [x0, x0+cw) is non-empty and lies inside a height x width image
// (no arithmetic that can overflow for non-negative sizes). Every entry point of the data layer checks its boxes with this before any pixel
// is touched.
bool box_inside(int height, int width, int y0, int x0, int ch, int cw);
// std::invalid_argument unless every channel's std is non-zero (normalising divides by it).
void check_std(const float std_[3]);

// Reusable buffers and the resampling itself (one per thread).
class Resampler {
 public:
  // Crops [y0, y0+ch) x [x0, x0+cw) of the image the source reads, resizes it to oh x ow, applies
  // `aug`, and writes (v/255 - mean)/std as oh x ow x 3 values of type `out_type` at `out`.
  // The source is asked only for the rows the filter touches (between y0 and y0+ch). The
  // AVX-512 path fuses multiply-adds, the portable one rounds each step: they agree to ~1e-6
  // after normalisation; each alone is deterministic (threads, crop position, tiles vs ROI).
  void run(RowSource& src, int y0, int x0, int ch, int cw, int oh, int ow, const Augment& aug, const float mean[3],
           const float std_[3], void* out, OutType out_type);

 private:
  Taps ty_, tx_;
  std::vector<uint8_t> ring_;  // taps_y rows of slot_bytes
  std::vector<const uint8_t*> row_ptr_;
  std::vector<int32_t> fx_;    // horizontal tap start of each output pixel, in floats from the row start
  std::vector<float> wx4_;     // horizontal weights in blocks of 4 taps, repeated over a pixel's 4 lanes
  std::vector<float> acc_;     // one vertically filtered row: cw x 4 (+ padding)
  std::vector<float> pix_;     // oh x ow x 3 before normalisation (with contrast/saturation or bf16)
};

// Crop + resize + augment + normalise one H x W x C uint8 image in memory (C = 1, 3 or 4) into
// out (oh x ow x 3 of out_type); std::invalid_argument for a box outside the image or a zero std.
void resize_image(const uint8_t* img, int height, int width, int channels, int y0, int x0, int ch, int cw, int oh,
                  int ow, const Augment& aug, const float mean[3], const float std_[3], void* out, OutType out_type);

}  // namespace data
}  // namespace fastxfer
