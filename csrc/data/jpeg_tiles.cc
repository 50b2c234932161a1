#include "data/jpeg_tiles.h"

#include <algorithm>
#include <cstring>

namespace fastxfer {
namespace data {

namespace {
inline int be16(const uint8_t* p) { return (p[0] << 8) | p[1]; }
}  // namespace

bool parse_tile_layout(const uint8_t* d, size_t n, TileLayout* t) {
  if (n < 4 || d[0] != 0xFF || d[1] != 0xD8) return false;
  size_t p = 2;
  int restart = 0, components = 0, hmax = 1, vmax = 1;
  bool frame = false;
  for (;;) {
    if (p + 4 > n || d[p] != 0xFF) return false;
    const int m = d[p + 1];
    if (m == 0xFF) {  // fill byte
      ++p;
      continue;
    }
    if (m == 0xD8 || m == 0xD9 || (m >= 0xD0 && m <= 0xD7) || m == 0x01) return false;  // no length: not a header
    const size_t len = static_cast<size_t>(be16(d + p + 2));
    if (len < 2 || p + 2 + len > n) return false;
    const uint8_t* s = d + p + 4;  // segment payload
    const size_t plen = len - 2;
    if (m == 0xC0 || m == 0xC1) {  // baseline / extended sequential, Huffman
      if (frame || plen < 6 || s[0] != 8) return false;
      t->height = be16(s + 1);
      t->width = be16(s + 3);
      components = s[5];
      if (components < 1 || plen < 6 + 3 * static_cast<size_t>(components)) return false;
      int hmin = 16, vmin = 16;
      for (int c = 0; c < components; ++c) {
        const int hv = s[6 + 3 * c + 1];
        if ((hv >> 4) < 1 || (hv & 15) < 1) return false;
        hmax = std::max(hmax, hv >> 4);
        vmax = std::max(vmax, hv & 15);
        hmin = std::min(hmin, hv >> 4);
        vmin = std::min(vmin, hv & 15);
      }
      t->subsampled = hmin != hmax || vmin != vmax;
      t->frame_size_at = p + 5;
      frame = true;
    } else if ((m >= 0xC2 && m <= 0xCF) && m != 0xC4 && m != 0xC8 && m != 0xCC) {
      return false;  // progressive, lossless, hierarchical or arithmetic-coded
    } else if (m == 0xDD) {
      if (plen < 2) return false;
      restart = be16(s);
    } else if (m == 0xDA) {
      if (!frame || plen < 1 || s[0] != components) return false;  // one interleaved scan of all components
      t->data_at = p + 2 + len;
      break;
    }
    p += 2 + len;
  }
  if (restart != 1 || t->height < 1 || t->width < 1) return false;
  // A single-component scan is not interleaved: its MCU is one 8x8 block.
  t->mcu_w = components == 1 ? 8 : 8 * hmax;
  t->mcu_h = components == 1 ? 8 : 8 * vmax;
  t->cols = (t->width + t->mcu_w - 1) / t->mcu_w;
  t->rows = (t->height + t->mcu_h - 1) / t->mcu_h;
  const size_t count = static_cast<size_t>(t->rows) * t->cols;
  // Every MCU ends in a 2-byte marker, so a file of n bytes holds at most (n - data_at) / 2 of
  // them: a forged frame size cannot make this reserve more than the data could describe.
  if (count > (n - t->data_at) / 2 + 1) return false;
  t->seg_end.clear();
  t->seg_end.reserve(count);
  // Restart markers (FF D0..D7, numbered k mod 8) end every MCU but the last, which ends at EOI.
  size_t q = t->data_at;
  while (t->seg_end.size() < count) {
    const void* hit = std::memchr(d + q, 0xFF, n - q);
    if (!hit) return false;
    q = static_cast<size_t>(static_cast<const uint8_t*>(hit) - d);
    if (q + 1 >= n) return false;
    const int m = d[q + 1];
    if (m == 0x00 || m == 0xFF) {  // stuffed byte / fill
      q += 1 + (m == 0x00);
      continue;
    }
    const size_t k = t->seg_end.size();
    const bool last = k + 1 == count;
    if (last ? m != 0xD9 : m != 0xD0 + static_cast<int>(k % 8)) return false;
    if (q > UINT32_MAX) return false;
    t->seg_end.push_back(static_cast<uint32_t>(q));
    q += 2;
  }
  return true;
}

void build_tile_jpeg(const uint8_t* d, const TileLayout& t, int r0, int r1, int c0, int c1, std::vector<uint8_t>* out) {
  const int h = std::min(t.height, r1 * t.mcu_h) - r0 * t.mcu_h;
  const int w = std::min(t.width, c1 * t.mcu_w) - c0 * t.mcu_w;
  size_t bytes = t.data_at + 2;
  for (int r = r0; r < r1; ++r) {
    const size_t k0 = static_cast<size_t>(r) * t.cols + c0, k1 = static_cast<size_t>(r) * t.cols + c1 - 1;
    const size_t start = k0 == 0 ? t.data_at : t.seg_end[k0 - 1] + 2;
    bytes += t.seg_end[k1] - start + 2;
  }
  out->resize(bytes);
  uint8_t* o = out->data();
  std::memcpy(o, d, t.data_at);
  o[t.frame_size_at] = static_cast<uint8_t>(h >> 8);
  o[t.frame_size_at + 1] = static_cast<uint8_t>(h);
  o[t.frame_size_at + 2] = static_cast<uint8_t>(w >> 8);
  o[t.frame_size_at + 3] = static_cast<uint8_t>(w);
  o += t.data_at;
  const int total = (r1 - r0) * (c1 - c0);
  int j = 0;
  for (int r = r0; r < r1; ++r) {
    for (int c = c0; c < c1; ++c) {
      const size_t k = static_cast<size_t>(r) * t.cols + c;
      const size_t start = k == 0 ? t.data_at : t.seg_end[k - 1] + 2;
      const size_t len = t.seg_end[k] - start;
      std::memcpy(o, d + start, len);
      o += len;
      *o++ = 0xFF;
      *o++ = static_cast<uint8_t>(++j == total ? 0xD9 : 0xD0 + (j - 1) % 8);
    }
  }
  out->resize(static_cast<size_t>(o - out->data()));
}

}  // namespace data
}  // namespace fastxfer
