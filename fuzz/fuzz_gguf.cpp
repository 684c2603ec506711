// libFuzzer entry for the GGUF reader: parse an arbitrary image, then read
// every metadata value through the typed getters and every tensor through its
// view (all bytes, plus reference dequantization of the first row).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/gguf.h"
#include "kernels/cpu/dequant.h"

namespace {

using loom::gguf::File;
using loom::gguf::ValueType;

void touch_value(const File& f, const std::string& key, const loom::gguf::Value& v) {
  try {
    switch (v.type) {
      case ValueType::string: (void)f.get_string(key); break;
      case ValueType::boolean: (void)f.get_bool(key); break;
      case ValueType::f32: case ValueType::f64: (void)f.get_float(key); break;
      case ValueType::array:
        (void)f.get_string_array(key);
        break;
      default:
        (void)f.get_int(key);
        (void)f.get_uint(key);
        (void)f.get_float(key);
        break;
    }
  } catch (const loom::Error&) {
    // Wrong-type and range errors are expected; crashes are not.
  }
  if (v.type == ValueType::array) {
    try { (void)f.get_f32_array(key); } catch (const loom::Error&) {}
    try { (void)f.get_i32_array(key); } catch (const loom::Error&) {}
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<File> f;
  try {
    f = File::parse(data, size, "fuzz.gguf");
  } catch (const loom::Error&) {
    return 0;
  }
  for (const auto& [key, v] : f->metadata()) touch_value(*f, key, v);
  unsigned sum = 0;
  std::vector<float> row;
  for (const auto& t : f->tensors()) {
    const loom::Tensor view = t.view();
    // The reader promised the view's bytes lie inside the input.
    if (view.nbytes() != t.nbytes || t.data < data || t.data + t.nbytes > data + size) std::abort();
    for (size_t i = 0; i < t.nbytes; ++i) sum += t.data[i];
    row.resize(static_cast<size_t>(view.cols()));
    loom::dequantize_row(t.dtype, view.row_ptr(0), row.data(), view.cols());
    if (f->find_tensor(t.name) != &t) std::abort();
  }
  volatile unsigned sink = sum;
  (void)sink;
  return 0;
}
