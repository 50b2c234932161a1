// Element types fastxfer moves, and the wire formats float32 gradients are compressed to.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fastxfer {

// The values are part of the C interface (engine/c_api.h FX_*) and of the records ranks exchange.
enum class DType : int32_t {
  kFloat32 = 0, kFloat64, kFloat16, kBFloat16, kInt32, kInt64,
  kUInt8, kInt8, kUInt16, kInt16, kBool  // bool: one byte, 0 or 1 (numpy's and TensorFlow's layout)
};
constexpr int32_t kNumDTypes = 11;

// How float32 data travels: as is, or rounded to bf16 / fp16 (accumulated back in float32).
enum class Compression : int32_t { kNone = 0, kBF16, kFP16 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: case DType::kInt32: return 4;
    case DType::kFloat64: case DType::kInt64: return 8;
    case DType::kFloat16: case DType::kBFloat16: case DType::kUInt16: case DType::kInt16: return 2;
    case DType::kUInt8: case DType::kInt8: case DType::kBool: return 1;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kUInt16: return "uint16";
    case DType::kInt16: return "int16";
    case DType::kBool: return "bool";
  }
  return "?";
}

// Parses the numpy dtype name (ml_dtypes names bfloat16 "bfloat16"). Throws std::invalid_argument.
inline DType dtype_from_name(const std::string& name) {
  if (name == "float32") return DType::kFloat32;
  if (name == "float64") return DType::kFloat64;
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "int32") return DType::kInt32;
  if (name == "int64") return DType::kInt64;
  if (name == "uint8") return DType::kUInt8;
  if (name == "int8") return DType::kInt8;
  if (name == "uint16") return DType::kUInt16;
  if (name == "int16") return DType::kInt16;
  if (name == "bool") return DType::kBool;
  throw std::invalid_argument("unsupported dtype '" + name +
                              "': expected float32, float64, float16, bfloat16, int32, int64, uint8, int8, uint16, "
                              "int16 or bool");
}

// Integer dtypes (bool excluded): sums wrap, averages truncate (docs/algorithms.md).
inline bool is_integer(DType t) {
  switch (t) {
    case DType::kInt32: case DType::kInt64: case DType::kUInt8: case DType::kInt8: case DType::kUInt16:
    case DType::kInt16: return true;
    default: return false;
  }
}

inline const char* compression_name(Compression c) {
  switch (c) {
    case Compression::kNone: return "none";
    case Compression::kBF16: return "bf16";
    case Compression::kFP16: return "fp16";
  }
  return "?";
}

inline Compression compression_from_name(const std::string& name) {
  if (name == "none") return Compression::kNone;
  if (name == "bf16" || name == "bfloat16") return Compression::kBF16;
  if (name == "fp16" || name == "float16") return Compression::kFP16;
  throw std::invalid_argument("unknown compression '" + name + "': expected 'none', 'bf16' or 'fp16'");
}

// The dtype a tensor of type `t` has on the wire: only float32 is ever compressed.
inline DType wire_dtype(DType t, Compression c) {
  if (t != DType::kFloat32 || c == Compression::kNone) return t;
  return c == Compression::kBF16 ? DType::kBFloat16 : DType::kFloat16;
}

}  // namespace fastxfer
