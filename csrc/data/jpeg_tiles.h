// Tiled JPEGs: a baseline JPEG whose restart interval is one MCU has every MCU in its own
// byte-aligned, independently decodable segment (the DC predictors reset at each restart marker).
// From such a file a crop's MCUs can be cut out into a smaller, valid JPEG -- same tables, a
// patched frame size, the segments of the crop's MCU rows and columns with renumbered restart
// markers -- so that entropy decoding, the bulk of decoding, costs the crop's area instead of every
// row above and beside it. `fastxfer data pack` writes its records this way (a lossless
// transcode: the DCT coefficients are unchanged).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace fastxfer {
namespace data {

struct TileLayout {
  int height = 0, width = 0;  // image size in pixels
  int mcu_h = 0, mcu_w = 0;   // MCU size in pixels
  int rows = 0, cols = 0;     // MCUs down and across
  bool subsampled = false;    // some component has fewer samples (its upsampling looks across MCUs)
  size_t frame_size_at = 0;   // offset of the 4 bytes of height, width in the SOF segment
  size_t data_at = 0;         // first byte of entropy-coded data
  // seg_end[k]: one past the last entropy byte of MCU k (k in scan order); MCU k starts at
  // data_at for k = 0, else at seg_end[k - 1] + 2 (after the restart marker).
  std::vector<uint32_t> seg_end;
};

// True when `data` is a single-scan baseline/extended-sequential Huffman JPEG with a restart
// marker after every MCU, correctly numbered; fills `t`. Never reads out of bounds; anything
// unexpected returns false (the caller then decodes the file the ordinary way).
bool parse_tile_layout(const uint8_t* data, size_t size, TileLayout* t);

// The JPEG holding MCU rows [r0, r1) and columns [c0, c1) of `data` (laid out as `t` says).
void build_tile_jpeg(const uint8_t* data, const TileLayout& t, int r0, int r1, int c0, int c1,
                     std::vector<uint8_t>* out);

}  // namespace data
}  // namespace fastxfer
