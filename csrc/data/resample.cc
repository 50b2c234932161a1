// The streaming resampler: taps, the row ring, and the finish (colour jitter, bf16); the inner
// loops are SIMD kernels chosen at run time (kernels/resample_*.cc).
#include "data/resample.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/reference.h"
#include "kernels/resample_kernels.h"

namespace fastxfer {
namespace data {

namespace {

inline double clamp255(double v) { return std::min(std::max(v, 0.0), 255.0); }

}  // namespace

void make_taps(int start, int length, int out_len, Taps* t) {
  // Same arithmetic as kernels._weights: float64 geometry, float32 weights normalised by the
  // float64 sum of the unrounded ones.
  const double scale = static_cast<double>(length) / out_len;
  const double fscale = std::max(scale, 1.0);
  const double support = fscale;
  const int kmax = static_cast<int>(std::ceil(support)) * 2 + 1;
  t->out_len = out_len;
  t->taps = kmax;
  t->first.assign(out_len, 0);
  t->count.assign(out_len, 0);
  t->w.assign(static_cast<size_t>(out_len) * kmax, 0.0f);
  // Geometry relative to `start`, so the weights do not depend on where the crop lies (a tile
  // cut and the whole image give the same bits).
  for (int o = 0; o < out_len; ++o) {
    const double center = (o + 0.5) * scale;
    const int lo = std::max(static_cast<int>(center - support + 0.5), 0);
    const int hi = std::min(static_cast<int>(center + support + 0.5), length);
    const int n = std::max(0, std::min(hi - lo, kmax));
    float* w = &t->w[static_cast<size_t>(o) * kmax];
    double total = 0.0;
    for (int k = 0; k < n; ++k) {
      double v = 1.0 - std::fabs((lo + k - center + 0.5) / fscale);
      if (v < 0.0) v = 0.0;
      w[k] = static_cast<float>(v);
      total += v;
    }
    if (total > 0.0)
      for (int k = 0; k < n; ++k) w[k] = static_cast<float>(static_cast<double>(w[k]) / total);
    t->first[o] = start + lo;
    t->count[o] = n;
  }
  // Keep only as many taps per output as the widest one uses (the rest are zero weights).
  int used = 1;
  for (int o = 0; o < out_len; ++o) used = std::max(used, t->count[o]);
  if (used < kmax) {
    for (int o = 0; o < out_len; ++o)
      std::memmove(&t->w[static_cast<size_t>(o) * used], &t->w[static_cast<size_t>(o) * kmax], used * sizeof(float));
    t->w.resize(static_cast<size_t>(out_len) * used);
    t->taps = used;
  }
}

void U8Rows::read_row(int row, uint8_t* slot) {
  const uint8_t* p = data_ + (static_cast<size_t>(row) * width_ + x0_) * channels_;
  if (channels_ == 4) {
    std::memcpy(slot, p, static_cast<size_t>(cw_) * 4);
    return;
  }
  const int g = channels_ >= 3;
  for (int i = 0; i < cw_; ++i) {
    const uint8_t* q = p + static_cast<size_t>(i) * channels_;
    slot[4 * i] = q[0];
    slot[4 * i + 1] = q[g];
    slot[4 * i + 2] = q[2 * g];
    slot[4 * i + 3] = 0;
  }
}

void Resampler::run(RowSource& src, int y0, int x0, int ch, int cw, int oh, int ow, const Augment& aug,
                    const float mean[3], const float std_[3], void* out, OutType out_type) {
  const ResampleKernels& kern = resample_kernels();
  make_taps(y0, ch, oh, &ty_);
  make_taps(x0, cw, ow, &tx_);
  const int ring_rows = ty_.taps;
  const size_t slot = src.slot_bytes();
  const size_t skip = static_cast<size_t>(src.slot_offset()) * 4;
  const size_t row_floats = static_cast<size_t>(cw) * 4;
  ring_.resize(ring_rows * slot);
  row_ptr_.resize(ring_rows);
  // Horizontal taps in blocks of four (zero weights past an output's own taps), each weight
  // repeated over the 4 lanes of a pixel; acc is padded so a block never reads past its end.
  const int blocks = (tx_.taps + 3) / 4;
  fx_.resize(ow);
  wx4_.assign(static_cast<size_t>(ow) * blocks * 16, 0.0f);
  for (int x = 0; x < ow; ++x) {
    fx_[x] = (tx_.first[x] - x0) * 4;
    for (int k = 0; k < tx_.taps; ++k) {
      float* w = &wx4_[(static_cast<size_t>(x) * blocks * 4 + k) * 4];
      w[0] = w[1] = w[2] = w[3] = tx_.w[static_cast<size_t>(x) * tx_.taps + k];
    }
  }
  acc_.assign(row_floats + static_cast<size_t>(blocks) * 16, 0.0f);

  const bool simple = aug.contrast == 1.0f && aug.saturation == 1.0f;
  float sc[3], off[3];
  for (int c = 0; c < 3; ++c) {
    sc[c] = 1.0f / (255.0f * std_[c]);
    off[c] = mean[c] / std_[c];
  }
  const float bright4[4] = {aug.brightness, aug.brightness, aug.brightness, aug.brightness};
  const float sc4[4] = {sc[0], sc[1], sc[2], 0.0f}, off4[4] = {off[0], off[1], off[2], 0.0f};
  // Rows go straight to a float32 output; bf16 and colour jitter go through pix_ first.
  const bool direct = simple && out_type == OutType::kFloat32;
  if (!direct) pix_.resize(static_cast<size_t>(oh) * ow * 3);
  float* out_f = static_cast<float*>(out);
  uint16_t* out_h = static_cast<uint16_t*>(out);

  int next_row = ty_.first[0];
  for (int o = 0; o < oh; ++o) {
    const int lo = ty_.first[o], n = ty_.count[o];
    for (; next_row < lo + n; ++next_row) src.read_row(next_row, &ring_[(next_row % ring_rows) * slot]);
    for (int k = 0; k < n; ++k) row_ptr_[k] = &ring_[((lo + k) % ring_rows) * slot] + skip;
    const float* wy = &ty_.w[static_cast<size_t>(o) * ty_.taps];
    float* dst = (direct ? out_f : pix_.data()) + static_cast<size_t>(o) * ow * 3;
    kern.vertical(acc_.data(), row_ptr_.data(), wy, n, row_floats);
    kern.row(dst, acc_.data(), fx_.data(), wx4_.data(), blocks, ow, aug.flip, bright4, sc4, off4, simple);
  }
  if (direct) return;
  const size_t total = static_cast<size_t>(oh) * ow;
  if (simple) {  // bf16 of exactly the float32 values
    for (size_t i = 0; i < 3 * total; ++i) out_h[i] = ref::f32_to_bf16(pix_[i]);
    return;
  }
  double gray_sum = 0.0;
  for (size_t i = 0; i < total; ++i)
    gray_sum += 0.299 * pix_[3 * i] + 0.587 * pix_[3 * i + 1] + 0.114 * pix_[3 * i + 2];
  const double gray_mean = gray_sum / static_cast<double>(total);
  const double con = aug.contrast, sat = aug.saturation;
  for (size_t i = 0; i < total; ++i) {
    double v[3] = {pix_[3 * i], pix_[3 * i + 1], pix_[3 * i + 2]};
    if (con != 1.0)
      for (double& c : v) c = clamp255((c - gray_mean) * con + gray_mean);
    if (sat != 1.0) {
      const double g = 0.299 * v[0] + 0.587 * v[1] + 0.114 * v[2];
      for (double& c : v) c = clamp255((c - g) * sat + g);
    }
    for (int c = 0; c < 3; ++c) {
      const float f = static_cast<float>(v[c] * sc[c] - off[c]);
      if (out_type == OutType::kFloat32)
        out_f[3 * i + c] = f;
      else
        out_h[3 * i + c] = ref::f32_to_bf16(f);
    }
  }
}

bool box_inside(int height, int width, int y0, int x0, int ch, int cw) {
  return ch >= 1 && cw >= 1 && y0 >= 0 && x0 >= 0 && y0 <= height - ch && x0 <= width - cw;
}

void check_std(const float std_[3]) {
  for (int c = 0; c < 3; ++c)
    if (!(std_[c] != 0.0f)) throw std::invalid_argument("std must be non-zero in every channel");
}

void resize_image(const uint8_t* img, int height, int width, int channels, int y0, int x0, int ch, int cw, int oh,
                  int ow, const Augment& aug, const float mean[3], const float std_[3], void* out, OutType out_type) {
  if (!(channels == 1 || channels == 3 || channels == 4))
    throw std::invalid_argument("img must be H x W x C with C = 1, 3 or 4");
  if (oh < 1 || ow < 1) throw std::invalid_argument("out must not be empty");
  if (!box_inside(height, width, y0, x0, ch, cw))
    throw std::invalid_argument("crop box (y0=" + std::to_string(y0) + ", x0=" + std::to_string(x0) + ", h=" +
                                std::to_string(ch) + ", w=" + std::to_string(cw) + ") is not inside the " +
                                std::to_string(height) + "x" + std::to_string(width) + " image");
  check_std(std_);
  U8Rows rows(img, width, channels, x0, cw);
  Resampler r;
  r.run(rows, y0, x0, ch, cw, oh, ow, aug, mean, std_, out, out_type);
}

}  // namespace data
}  // namespace fastxfer
