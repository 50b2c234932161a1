// Region-of-interest JPEG decoding fused with the resampler: for each image of a batch, decode
// only the scanlines and iMCU columns a crop needs (libjpeg-turbo's jpeg_skip_scanlines and
// jpeg_crop_scanline), shrunk in the DCT domain by 1/2, 1/4 or 1/8 when the crop allows, and
// stream the rows straight into the resampler, which writes the normalised batch slot.
//
// libjpeg-turbo is not linked: it is opened at run time (dlopen) from a path the caller gives,
// normally the copy inside Pillow's wheel, so no system library is needed. The struct layout comes
// from the jpeglib.h found at build time; the library checks it (version 62 and the struct size)
// when a decoder is created, and a mismatch is an error naming both.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "data/resample.h"

namespace fastxfer {
namespace data {

// True when this build has the JPEG decoder (jpeglib.h with the version 62 ABI was found).
bool jpeg_support_built();
// Why not, when it is not built.
std::string jpeg_support_note();

struct JpegImage {
  const uint8_t* data = nullptr;
  size_t size = 0;
  int height = 0, width = 0;  // what the dataset index says; the JPEG header must agree
  int y = 0, x = 0, h = 0, w = 0;  // crop box in full-resolution pixels
  Augment aug;
};

class JpegLibrary;

// Decodes batches on its own pool of threads. Thread-safe: one batch at a time (later callers wait).
class BatchDecoder {
 public:
  // Opens libjpeg-turbo at `library_path`. Throws std::runtime_error naming the path and the
  // reason (not found, not libjpeg-turbo, ABI mismatch).
  BatchDecoder(const std::string& library_path, int threads, int64_t max_pixels);
  ~BatchDecoder();

  const std::string& library_path() const;
  int threads() const { return threads_; }

  // Decodes, crops, resizes and normalises images[i] into out + i * out_h*out_w*3 elements of
  // out_type. Returns one message per image: empty on success, else why the image was not
  // written (corrupt data, unsupported format, header that disagrees with the index, too large).
  std::vector<std::string> decode_batch(const std::vector<JpegImage>& images, int out_h, int out_w,
                                        const float mean[3], const float std_[3], void* out, OutType out_type);

  // Lossless transcode of one JPEG to the tiled form (jpeg_tiles.h) on the calling thread.
  // Throws std::runtime_error with libjpeg's reason for data it cannot transcode.
  std::vector<uint8_t> transcode(const uint8_t* data, size_t size);

  // Testing/benchmark switch: false decodes tiled records the ordinary way (region of interest).
  void set_tiles(bool on);
  // Benchmark switch: decode the rows each crop needs and drop them (no resampling, out untouched).
  void set_decode_only(bool on);

 private:
  struct Worker;
  std::shared_ptr<JpegLibrary> lib_;
  int threads_;
  int64_t max_pixels_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::unique_ptr<Worker> transcoder_;  // pack time, guarded by transcode_mu_
  std::unique_ptr<std::mutex> transcode_mu_;
  struct Pool;
  std::unique_ptr<Pool> pool_;
};

}  // namespace data
}  // namespace fastxfer
