// Resolving TensorFlow's C API from the TensorFlow that loaded us.
#include "tfops/tf_c.h"

#include <dlfcn.h>
#include <link.h>

#include <cstring>
#include <string>

namespace fastxfer {
namespace tfops {

TfApi tf;

namespace {

// A function-local static: resolve_tf_api() runs from another file's static initializer.
std::string& load_error() {
  static std::string e;
  return e;
}

int find_framework(struct dl_phdr_info* info, size_t, void* data) {
  const char* name = info->dlpi_name;
  if (name != nullptr && std::strstr(name, "libtensorflow_framework.so") != nullptr) {
    *static_cast<std::string*>(data) = name;
    return 1;
  }
  return 0;
}

}  // namespace

const char* resolve_tf_api() {
  // tf.load_op_library runs with TensorFlow loaded: find its framework library (by path, since
  // Python extensions load their dependencies privately) without loading anything new.
  std::string path;
  dl_iterate_phdr(find_framework, &path);
  void* h = path.empty() ? nullptr : dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) h = dlopen("libtensorflow_framework.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) {
    load_error() = "libtensorflow_framework is not loaded in this process (import tensorflow first)";
    return load_error().c_str();
  }
#define FASTXFER_TF_RESOLVE(ret, name, args)                                                   \
  tf.name = reinterpret_cast<ret(*) args>(dlsym(h, #name));                                    \
  if (tf.name == nullptr) {                                                                    \
    load_error() = std::string("this TensorFlow's ") + (path.empty() ? "framework library" : path) + \
              " has no C API function " #name;                                                 \
    return load_error().c_str();                                                                    \
  }
  FASTXFER_TF_FUNCTIONS(FASTXFER_TF_RESOLVE)
#undef FASTXFER_TF_RESOLVE
  // The library stays loaded as long as TensorFlow does; the handle is deliberately kept.
  return "";
}

}  // namespace tfops
}  // namespace fastxfer
