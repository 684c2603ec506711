// Writer for safetensors files (F32 / F16 / BF16 tensors, integer tensors of
// quantized checkpoints, plus __metadata__),
// laid out like the reference library: compact JSON header padded with spaces
// to a multiple of 8, tensor data back to back. Written via temp file + rename.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/safetensors.h"

namespace loom::safetensors {

enum class WriteOrder {
  as_given,   // tensors in the order they were added
  reference,  // as the Python library: by dtype (F32, BF16, F16) then by name
};

class Writer {
 public:
  // `path` is only used at write() time and in error messages.
  explicit Writer(std::string path);

  // Adds fp32 values stored as `dtype` (F32, F16 or BF16; F16/BF16 rounded to
  // nearest even). `values.size()` must equal the product of `shape`.
  // Throws invalid_input (unsupported dtype, size mismatch, duplicate or
  // reserved name) naming the file and the tensor.
  void add(std::string name, std::span<const float> values, std::vector<int64_t> shape,
           StDType dtype = StDType::f32);
  // Adds already-encoded little-endian element bytes of `dtype` (F32, F16, BF16,
  // or the types of quantized checkpoints: I8, U8, I32, I64, F8_E4M3).
  void add_raw(std::string name, StDType dtype, std::vector<int64_t> shape, std::string_view bytes);
  void set_metadata(std::string key, std::string value);

  size_t size() const { return tensors_.size(); }
  // The whole file image.
  std::string serialize(WriteOrder order = WriteOrder::as_given) const;
  // serialize() and write atomically to the path; throws io naming the file.
  void write(WriteOrder order = WriteOrder::as_given) const;

 private:
  struct Entry {
    std::string name;
    StDType dtype;
    std::vector<int64_t> shape;
    std::string bytes;
  };
  void check_new(const std::string& name, StDType dtype, const std::vector<int64_t>& shape, size_t n_bytes,
                 bool raw) const;

  std::string path_;
  std::vector<Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace loom::safetensors
