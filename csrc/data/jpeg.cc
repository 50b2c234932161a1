#include "data/jpeg.h"

#include <atomic>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unistd.h>
#include <stdexcept>

#include "common/parallel.h"
#include "data/jpeg_tiles.h"

#if FASTXFER_HAVE_JPEGLIB
#include <dlfcn.h>
extern "C" {
#include <jpeglib.h>
}
#if JPEG_LIB_VERSION != 62
#undef FASTXFER_HAVE_JPEGLIB
#define FASTXFER_HAVE_JPEGLIB 0
#define FASTXFER_JPEG_ABI_NOTE "the jpeglib.h found at build time has the libjpeg ABI " \
  "version " FASTXFER_STR(JPEG_LIB_VERSION) ", but Pillow's libjpeg-turbo has version 62"
#endif
#endif

#define FASTXFER_STR2(x) #x
#define FASTXFER_STR(x) FASTXFER_STR2(x)

namespace fastxfer {
namespace data {

#if !FASTXFER_HAVE_JPEGLIB

bool jpeg_support_built() { return false; }
std::string jpeg_support_note() {
#ifdef FASTXFER_JPEG_ABI_NOTE
  return FASTXFER_JPEG_ABI_NOTE;
#else
  return "fastxfer was built without jpeglib.h (install libjpeg-turbo's headers, e.g. Debian's "
         "libjpeg62-turbo-dev, and reinstall fastxfer)";
#endif
}

class JpegLibrary {};
struct BatchDecoder::Worker {};
struct BatchDecoder::Pool {};

BatchDecoder::BatchDecoder(const std::string&, int, int64_t) { throw std::runtime_error(jpeg_support_note()); }
BatchDecoder::~BatchDecoder() = default;
const std::string& BatchDecoder::library_path() const { throw std::runtime_error(jpeg_support_note()); }
std::vector<std::string> BatchDecoder::decode_batch(const std::vector<JpegImage>&, int, int, const float*,
                                                    const float*, void*, OutType) {
  throw std::runtime_error(jpeg_support_note());
}
std::vector<uint8_t> BatchDecoder::transcode(const uint8_t*, size_t) { throw std::runtime_error(jpeg_support_note()); }
void BatchDecoder::set_tiles(bool) {}
void BatchDecoder::set_decode_only(bool) {}

#else  // FASTXFER_HAVE_JPEGLIB

bool jpeg_support_built() { return true; }
std::string jpeg_support_note() { return "built with jpeglib.h (libjpeg ABI 62)"; }

// The functions fastxfer calls, looked up in the library opened at run time. The types come from
// jpeglib.h; `decltype(&f)` only names them, so nothing links against a system libjpeg.
class JpegLibrary {
 public:
  explicit JpegLibrary(const std::string& path) : path_(path) {
    handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle_) {
      const char* e = dlerror();
      throw std::runtime_error("cannot open libjpeg-turbo at '" + path + "': " + (e ? e : "unknown error"));
    }
    try {
      bind(std_error, "jpeg_std_error");
      bind(create_decompress, "jpeg_CreateDecompress");
      bind(destroy_decompress, "jpeg_destroy_decompress");
      bind(mem_src, "jpeg_mem_src");
      bind(read_header, "jpeg_read_header");
      bind(start_decompress, "jpeg_start_decompress");
      bind(read_scanlines, "jpeg_read_scanlines");
      bind(abort_decompress, "jpeg_abort_decompress");
      bind(crop_scanline, "jpeg_crop_scanline");   // libjpeg-turbo >= 1.5 only
      bind(skip_scanlines, "jpeg_skip_scanlines");
      bind(read_coefficients, "jpeg_read_coefficients");
      bind(finish_decompress, "jpeg_finish_decompress");
      bind(create_compress, "jpeg_CreateCompress");
      bind(destroy_compress, "jpeg_destroy_compress");
      bind(copy_critical_parameters, "jpeg_copy_critical_parameters");
      bind(write_coefficients, "jpeg_write_coefficients");
      bind(finish_compress, "jpeg_finish_compress");
    } catch (...) {
      dlclose(handle_);
      throw;
    }
  }
  ~JpegLibrary() { dlclose(handle_); }
  const std::string& path() const { return path_; }

  decltype(&::jpeg_std_error) std_error = nullptr;
  decltype(&::jpeg_CreateDecompress) create_decompress = nullptr;
  decltype(&::jpeg_destroy_decompress) destroy_decompress = nullptr;
  decltype(&::jpeg_mem_src) mem_src = nullptr;
  decltype(&::jpeg_read_header) read_header = nullptr;
  decltype(&::jpeg_start_decompress) start_decompress = nullptr;
  decltype(&::jpeg_read_scanlines) read_scanlines = nullptr;
  decltype(&::jpeg_abort_decompress) abort_decompress = nullptr;
  decltype(&::jpeg_crop_scanline) crop_scanline = nullptr;
  decltype(&::jpeg_skip_scanlines) skip_scanlines = nullptr;
  decltype(&::jpeg_read_coefficients) read_coefficients = nullptr;
  decltype(&::jpeg_finish_decompress) finish_decompress = nullptr;
  decltype(&::jpeg_CreateCompress) create_compress = nullptr;
  decltype(&::jpeg_destroy_compress) destroy_compress = nullptr;
  decltype(&::jpeg_copy_critical_parameters) copy_critical_parameters = nullptr;
  decltype(&::jpeg_write_coefficients) write_coefficients = nullptr;
  decltype(&::jpeg_finish_compress) finish_compress = nullptr;

 private:
  template <class F>
  void bind(F& fn, const char* name) {
    void* p = dlsym(handle_, name);
    if (!p)
      throw std::runtime_error("'" + path_ + "' has no " + name + ": it is not libjpeg-turbo 1.5 or newer");
    fn = reinterpret_cast<F>(p);
  }
  std::string path_;
  void* handle_ = nullptr;
};

namespace {

// libjpeg reports errors by calling error_exit, which must not return: it longjmps back to the
// decode call. Warnings (corrupt data that libjpeg would paper over with grey) are errors too.
struct ErrorManager {
  jpeg_error_mgr pub;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX + 64];
};

void on_error(j_common_ptr c) {
  auto* e = reinterpret_cast<ErrorManager*>(c->err);
  (*c->err->format_message)(c, e->message);
  longjmp(e->jump, 1);
}

void on_message(j_common_ptr c, int level) {
  if (level < 0) on_error(c);  // a warning: the image is damaged
}

[[noreturn]] void fail(ErrorManager* e, const char* text) {
  std::snprintf(e->message, sizeof(e->message), "%s", text);
  longjmp(e->jump, 1);
}

// Feeds the resampler from libjpeg's scanlines: skips ahead (entropy decoding only) to the first
// row asked for, and has libjpeg write each row straight into the resampler's ring slot.
class JpegRows : public RowSource {
 public:
  JpegRows(JpegLibrary* lib, jpeg_decompress_struct* c, ErrorManager* err) : lib_(lib), c_(c), err_(err) {}
  void start(size_t line_pixels, int col0, bool cmyk) {
    line_pixels_ = line_pixels;
    col0_ = col0;
    cmyk_ = cmyk;
  }
  size_t slot_bytes() const override { return line_pixels_ * 4; }
  int slot_offset() const override { return col0_; }

  void read_row(int row, uint8_t* slot) override {
    const int at = static_cast<int>(c_->output_scanline);
    if (at < row) lib_->skip_scanlines(c_, static_cast<JDIMENSION>(row - at));
    if (static_cast<int>(c_->output_scanline) != row) fail(err_, "cannot seek to the crop's first row");
    JSAMPROW r = slot;
    if (lib_->read_scanlines(c_, &r, 1) != 1) fail(err_, "the JPEG data ended early");
    if (cmyk_) {  // Adobe CMYK as libjpeg delivers it (inverted): R = C*K/255 (truncated), and so on
      for (size_t i = 0; i < line_pixels_; ++i) {
        uint8_t* p = slot + 4 * i;
        const unsigned k = p[3];
        p[0] = static_cast<uint8_t>(p[0] * k / 255u);
        p[1] = static_cast<uint8_t>(p[1] * k / 255u);
        p[2] = static_cast<uint8_t>(p[2] * k / 255u);
      }
    }
  }

 private:
  JpegLibrary* lib_;
  jpeg_decompress_struct* c_;
  ErrorManager* err_;
  size_t line_pixels_ = 0;
  int col0_ = 0;
  bool cmyk_ = false;
};

}  // namespace

// A libjpeg destination that appends to a malloc'd buffer owned here (grown with realloc; on
// failure it reports through the error manager, which longjmps). Unlike jpeg_mem_dest, the
// pointer is never left dangling on an error path, and the buffer is reused across calls.
class GrowingDestination {
 public:
  ~GrowingDestination() { std::free(buf_); }
  void start(j_compress_ptr c, ErrorManager* err) {
    err_ = err;
    pub_.init_destination = init;
    pub_.empty_output_buffer = empty;
    pub_.term_destination = term;
    c->dest = &pub_;
  }
  const uint8_t* data() const { return buf_; }
  size_t size() const { return used_; }

 private:
  static GrowingDestination* self(j_compress_ptr c) {
    return reinterpret_cast<GrowingDestination*>(reinterpret_cast<char*>(c->dest) -
                                                offsetof(GrowingDestination, pub_));
  }
  void grow(size_t want) {
    if (want <= cap_) return;
    size_t cap = std::max<size_t>(want, cap_ * 2);
    auto* p = static_cast<uint8_t*>(std::realloc(buf_, cap));
    if (!p) fail(err_, "out of memory while transcoding");
    buf_ = p;
    cap_ = cap;
  }
  static void init(j_compress_ptr c) {
    GrowingDestination* d = self(c);
    d->used_ = 0;
    d->grow(1 << 16);
    d->pub_.next_output_byte = d->buf_;
    d->pub_.free_in_buffer = d->cap_;
  }
  static boolean empty(j_compress_ptr c) {  // the whole buffer is full
    GrowingDestination* d = self(c);
    const size_t used = d->cap_;
    d->grow(d->cap_ * 2);
    d->pub_.next_output_byte = d->buf_ + used;
    d->pub_.free_in_buffer = d->cap_ - used;
    return TRUE;
  }
  static void term(j_compress_ptr c) {
    GrowingDestination* d = self(c);
    d->used_ = d->cap_ - d->pub_.free_in_buffer;
  }

  jpeg_destination_mgr pub_{};
  ErrorManager* err_ = nullptr;
  uint8_t* buf_ = nullptr;
  size_t cap_ = 0, used_ = 0;
};

struct BatchDecoder::Worker {
  explicit Worker(JpegLibrary* lib) : lib_(lib), rows_(lib, &cinfo_, &err_) {
    std::memset(&cinfo_, 0, sizeof(cinfo_));
    cinfo_.err = lib_->std_error(&err_.pub);
    err_.pub.error_exit = on_error;
    err_.pub.emit_message = on_message;
    if (setjmp(err_.jump)) {
      create_error_ = std::string("libjpeg-turbo refused to start a decoder: ") + err_.message;
      return;
    }
    // The library checks the ABI version and the struct size we were compiled with.
    lib_->create_decompress(&cinfo_, JPEG_LIB_VERSION, sizeof(cinfo_));
    created_ = true;
  }
  ~Worker() {
    if (created_) lib_->destroy_decompress(&cinfo_);
  }
  const std::string& create_error() const { return create_error_; }

  // Decodes `im` into out; returns nullptr or the reason it failed (valid until the next call).
  const char* decode(const JpegImage& im, int oh, int ow, const float mean[3], const float std_[3], void* out,
                     OutType out_type, int64_t max_pixels) {
    if (!created_) return create_error_.c_str();
    const int H = im.height, W = im.width;
    if (static_cast<int64_t>(H) * W > max_pixels) {
      std::snprintf(err_.message, sizeof(err_.message), "the image is %dx%d = %lld pixels, over the limit of %lld",
                    W, H, static_cast<long long>(H) * W, static_cast<long long>(max_pixels));
      return err_.message;
    }
    // DCT-domain shrinking by the largest of 8/4/2 that leaves the crop at least the output size,
    // and the crop box in the decoded image's pixels (as loader.decode() maps it).
    int f = 1;
    for (int c : {8, 4, 2}) {
      if (im.h / c >= oh && im.w / c >= ow) {
        f = c;
        break;
      }
    }
    const int H2 = (H + f - 1) / f, W2 = (W + f - 1) / f;
    const double sy = static_cast<double>(H2) / H, sx = static_cast<double>(W2) / W;
    const int y2 = static_cast<int>(im.y * sy), x2 = static_cast<int>(im.x * sx);
    const int h2 = std::max(1, std::min(H2 - y2, static_cast<int>(std::nearbyint(im.h * sy))));
    const int w2 = std::max(1, std::min(W2 - x2, static_cast<int>(std::nearbyint(im.w * sx))));
    if (y2 < 0 || x2 < 0 || y2 >= H2 || x2 >= W2) {
      std::snprintf(err_.message, sizeof(err_.message), "the crop box lies outside the image");
      return err_.message;
    }
    // A tiled record (restart marker after every MCU): cut the crop's MCUs into a smaller JPEG,
    // plus one MCU on each side when chroma is subsampled, so that its upsampling at the crop's
    // edges sees the same neighbours as in the whole image (the pixels come out identical).
    if (tiles_enabled_ && parse_tile_layout(im.data, im.size, &layout_) && layout_.height == H &&
        layout_.width == W) {
      const TileLayout& t = layout_;
      const int m = t.subsampled ? 1 : 0;
      // The MCUs under the scaled box (y2, x2, h2, w2): full-resolution rows [y2 f, (y2 + h2) f).
      const int r0 = std::max(0, y2 * f / t.mcu_h - m);
      const int r1 = std::min(t.rows, ((y2 + h2) * f + t.mcu_h - 1) / t.mcu_h + m);
      const int c0 = std::max(0, x2 * f / t.mcu_w - m);
      const int c1 = std::min(t.cols, ((x2 + w2) * f + t.mcu_w - 1) / t.mcu_w + m);
      build_tile_jpeg(im.data, t, r0, r1, c0, c1, &tile_);
      const int hs = std::min(H, r1 * t.mcu_h) - r0 * t.mcu_h, ws = std::min(W, c1 * t.mcu_w) - c0 * t.mcu_w;
      const int dy = r0 * t.mcu_h / f, dx = c0 * t.mcu_w / f;  // MCU sizes are multiples of 8 >= f
      return decode_box(tile_.data(), tile_.size(), hs, ws, f, y2 - dy, x2 - dx, h2, w2, oh, ow, im.aug, mean, std_,
                        out, out_type);
    }
    return decode_box(im.data, im.size, H, W, f, y2, x2, h2, w2, oh, ow, im.aug, mean, std_, out, out_type);
  }

  void set_tiles(bool on) { tiles_enabled_ = on; }
  void set_decode_only(bool on) { decode_only_ = on; }

  // Lossless transcode to a tiled JPEG (see jpeg_tiles.h): same coefficients, optimised Huffman
  // tables, a restart marker after every MCU. Returns nullptr and fills `out`, or the reason.
  const char* transcode(const uint8_t* data, size_t size, int64_t max_pixels, std::vector<uint8_t>* out) {
    if (!created_) return create_error_.c_str();
    // State written after setjmp and read after a longjmp lives in this object, not in registers.
    tc_made_ = false;
    std::memset(&tc_, 0, sizeof(tc_));
    tc_.err = &err_.pub;  // one error manager (and jump target) for both structs
    if (setjmp(err_.jump)) {
      lib_->abort_decompress(&cinfo_);
      if (tc_made_) lib_->destroy_compress(&tc_);
      tc_made_ = false;
      return err_.message;
    }
    lib_->abort_decompress(&cinfo_);
    lib_->mem_src(&cinfo_, data, static_cast<unsigned long>(size));
    lib_->read_header(&cinfo_, TRUE);
    if (static_cast<int64_t>(cinfo_.image_height) * cinfo_.image_width > max_pixels)
      fail(&err_, "the image is over the pixel limit");
    jvirt_barray_ptr* coefs = lib_->read_coefficients(&cinfo_);
    lib_->create_compress(&tc_, JPEG_LIB_VERSION, sizeof(tc_));
    tc_made_ = true;
    dest_.start(&tc_, &err_);
    lib_->copy_critical_parameters(&cinfo_, &tc_);
    tc_.restart_interval = 1;
    tc_.optimize_coding = TRUE;
    lib_->write_coefficients(&tc_, coefs);
    lib_->finish_compress(&tc_);
    lib_->finish_decompress(&cinfo_);
    lib_->destroy_compress(&tc_);
    tc_made_ = false;
    out->assign(dest_.data(), dest_.data() + dest_.size());  // may throw: nothing of libjpeg's is held
    return nullptr;
  }

 private:
  // Decodes the JPEG `data` (hs x ws pixels, DCT-scaled by 1/f) and resamples the box
  // (y2, x2, h2, w2), given in the scaled image's pixels.
  const char* decode_box(const uint8_t* data, size_t size, int hs, int ws, int f, int y2, int x2, int h2, int w2,
                         int oh, int ow, const Augment& aug, const float mean[3], const float std_[3], void* out,
                         OutType out_type) {
    // No object with a destructor may live in this frame past setjmp (longjmp skips destructors).
    if (setjmp(err_.jump)) {
      lib_->abort_decompress(&cinfo_);
      return err_.message;
    }
    lib_->abort_decompress(&cinfo_);  // in case an exception left the previous image half done
    lib_->mem_src(&cinfo_, data, static_cast<unsigned long>(size));
    lib_->read_header(&cinfo_, TRUE);
    const int H = static_cast<int>(cinfo_.image_height), W = static_cast<int>(cinfo_.image_width);
    if (H != hs || W != ws) {
      std::snprintf(err_.message, sizeof(err_.message),
                    "the JPEG header says %dx%d (WxH) but the dataset index says %dx%d", W, H, ws, hs);
      longjmp(err_.jump, 1);
    }
    const bool cmyk = cinfo_.jpeg_color_space == JCS_CMYK || cinfo_.jpeg_color_space == JCS_YCCK;
    cinfo_.out_color_space = cmyk ? JCS_CMYK : JCS_EXT_RGBX;  // grayscale expands to RGBX too
    cinfo_.scale_num = 1;
    cinfo_.scale_denom = static_cast<unsigned>(f);
    cinfo_.dct_method = JDCT_ISLOW;
    cinfo_.do_fancy_upsampling = TRUE;
    lib_->start_decompress(&cinfo_);
    const int H2 = static_cast<int>(cinfo_.output_height), W2 = static_cast<int>(cinfo_.output_width);
    if (y2 < 0 || x2 < 0 || y2 + h2 > H2 || x2 + w2 > W2) fail(&err_, "the crop box lies outside the image");
    // Ask for one more column on each side: libjpeg-turbo upsamples subsampled chroma at the edges
    // of a cropped scanline as if they were the image's edges, so those columns differ from a
    // full decode. (It widens the request to whole iMCU columns anyway.)
    const int xa = std::max(0, x2 - 1), xb = std::min(W2, x2 + w2 + 1);
    JDIMENSION xoff = static_cast<JDIMENSION>(xa), cw = static_cast<JDIMENSION>(xb - xa);
    lib_->crop_scanline(&cinfo_, &xoff, &cw);
    if (cinfo_.output_components != 4) fail(&err_, "unexpected number of output components");
    rows_.start(cw, x2 - static_cast<int>(xoff), cmyk);
    if (decode_only_) {  // benchmark: the rows the crop needs, decoded and dropped
      scratch_.resize(rows_.slot_bytes());
      for (int r = y2; r < y2 + h2; ++r) rows_.read_row(r, scratch_.data());
    } else {
      resampler_.run(rows_, y2, x2, h2, w2, oh, ow, aug, mean, std_, out, out_type);
    }
    lib_->abort_decompress(&cinfo_);  // the rows below the crop are never decoded
    return nullptr;
  }

  JpegLibrary* lib_;
  jpeg_decompress_struct cinfo_;
  ErrorManager err_;
  bool created_ = false;
  std::string create_error_;
  JpegRows rows_;
  Resampler resampler_;
  bool tiles_enabled_ = true;
  bool decode_only_ = false;
  std::vector<uint8_t> scratch_;
  TileLayout layout_;
  std::vector<uint8_t> tile_;
  jpeg_compress_struct tc_;
  bool tc_made_ = false;
  GrowingDestination dest_;
};

struct BatchDecoder::Pool {
  WorkerPool pool;
};

BatchDecoder::BatchDecoder(const std::string& library_path, int threads, int64_t max_pixels)
    : lib_(std::make_shared<JpegLibrary>(library_path)),
      threads_(threads > 0 ? threads : default_threads()),
      max_pixels_(max_pixels),
      transcode_mu_(std::make_unique<std::mutex>()),
      pool_(std::make_unique<Pool>()) {
  for (int i = 0; i < threads_; ++i) {
    workers_.push_back(std::make_unique<Worker>(lib_.get()));
    if (!workers_.back()->create_error().empty()) throw std::runtime_error(workers_.back()->create_error());
  }
}

BatchDecoder::~BatchDecoder() {
  if (pool_ && pool_->pool.inherited())
    pool_.release();  // a copy from before fork(): its threads are not here (see WorkerPool::inherited)
  pool_.reset();  // stop the threads before their decoders go
  workers_.clear();
  transcoder_.reset();
}

std::vector<uint8_t> BatchDecoder::transcode(const uint8_t* data, size_t size) {
  // One transcoder per calling thread would allow parallel packing; packing threads each use
  // their own BatchDecoder instead, so one here, serialised, is enough.
  std::lock_guard<std::mutex> lk(*transcode_mu_);
  if (!transcoder_) transcoder_ = std::make_unique<Worker>(lib_.get());
  std::vector<uint8_t> out;
  if (const char* e = transcoder_->transcode(data, size, max_pixels_, &out)) throw std::runtime_error(e);
  return out;
}

void BatchDecoder::set_tiles(bool on) {
  std::lock_guard<std::mutex> own(pool_->pool.owner());
  for (auto& w : workers_) w->set_tiles(on);
}

void BatchDecoder::set_decode_only(bool on) {
  std::lock_guard<std::mutex> own(pool_->pool.owner());
  for (auto& w : workers_) w->set_decode_only(on);
}

const std::string& BatchDecoder::library_path() const { return lib_->path(); }

std::vector<std::string> BatchDecoder::decode_batch(const std::vector<JpegImage>& images, int out_h, int out_w,
                                                    const float mean[3], const float std_[3], void* out,
                                                    OutType out_type) {
  std::vector<std::string> errors(images.size());
  if (out_h < 1 || out_w < 1) throw std::invalid_argument("out must not be empty");
  check_std(std_);
  if (images.empty()) return errors;
  // The boxes against the sizes the index gives (a header that disagrees is a per-image error later).
  for (size_t i = 0; i < images.size(); ++i) {
    const JpegImage& im = images[i];
    if (!box_inside(im.height, im.width, im.y, im.x, im.h, im.w))
      throw std::invalid_argument("box of image " + std::to_string(i) + " is not inside its " +
                                  std::to_string(im.height) + "x" + std::to_string(im.width) + " image");
  }
  const size_t slot_bytes =
      static_cast<size_t>(out_h) * out_w * 3 * (out_type == OutType::kFloat32 ? sizeof(float) : sizeof(uint16_t));
  std::lock_guard<std::mutex> own(pool_->pool.owner());
  std::atomic<size_t> next{0};
  const int count = static_cast<int>(std::min<size_t>(static_cast<size_t>(threads_), images.size()));
  pool_->pool.run(count, [&](int t) {
    Worker& w = *workers_[t];
    for (size_t i; (i = next.fetch_add(1)) < images.size();) {
      void* slot = static_cast<uint8_t*>(out) + i * slot_bytes;
      if (const char* e = w.decode(images[i], out_h, out_w, mean, std_, slot, out_type, max_pixels_)) errors[i] = e;
    }
  });
  return errors;
}

#endif  // FASTXFER_HAVE_JPEGLIB

}  // namespace data
}  // namespace fastxfer
