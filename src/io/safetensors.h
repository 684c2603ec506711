// Reader for the safetensors format (Hugging Face weights, PEFT adapters) over
// a memory-mapped file. Every header field is validated before a view is made.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/mapped_file.h"
#include "core/tensor.h"

namespace loom::safetensors {

// Element types named in safetensors headers. Only the byte-sized ones; the
// sub-byte formats (F4, F6_*) are reported as unsupported.
enum class StDType {
  boolean, u8, i8, f8_e4m3, f8_e5m2, f8_e8m0, i16, u16, f16, bf16, i32, u32, f32, i64, u64, f64,
};

const char* st_dtype_name(StDType t);  // the header spelling: "BF16", "BOOL", ...
size_t st_dtype_size(StDType t);
std::optional<StDType> st_dtype_from_name(std::string_view name);
// The loom element type with the same memory layout, if there is one.
std::optional<DType> to_loom_dtype(StDType t);

// Largest JSON header accepted (the official reader uses the same bound).
inline constexpr uint64_t kMaxHeaderBytes = 100u * 1000u * 1000u;

struct TensorInfo {
  std::string name;
  StDType st_dtype = StDType::f32;
  int ndim = 0;
  std::array<int64_t, Tensor::kMaxDims> shape{};  // outermost first
  uint64_t begin = 0;   // data_offsets, relative to the first byte after the header
  uint64_t end = 0;
  const uint8_t* data = nullptr;  // into the mapping (or the parsed buffer)
  // Whether `data` is aligned to the element size. The format does not
  // promise it; consumers read through memcpy-safe paths, so this is only noted.
  bool aligned = true;

  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(end - begin); }
  // Non-owning view. Throws unsupported when the dtype has no loom DType
  // (BOOL, U8, F8_*, ...), naming `file` and the tensor.
  Tensor view(std::string_view file) const;
  // As view(), but only F32 / F16 / BF16 are accepted: what weight loaders use.
  Tensor weight_view(std::string_view file) const;
  std::string shape_string() const;
};

class File {
 public:
  // Maps and parses `path`. Throws loom::Error (not_found, io, invalid_input, unsupported).
  static std::unique_ptr<File> open(const std::string& path);
  // Parses an in-memory image (tests, fuzzing); `data` must outlive the File.
  static std::unique_ptr<File> parse(const uint8_t* data, size_t size, const std::string& name);

  const std::string& path() const { return name_; }
  // The optional "__metadata__" string map (PEFT / transformers put format info here).
  const std::map<std::string, std::string, std::less<>>& metadata() const { return metadata_; }
  // Tensors in file order (ascending data offset).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;
  size_t header_bytes() const { return header_bytes_; }
  // Number of tensors whose data is not aligned to their element size.
  size_t misaligned_count() const { return misaligned_; }

  // Convenience: view / weight_view of a named tensor, or not_found naming the file.
  Tensor view(std::string_view name) const;
  Tensor weight_view(std::string_view name) const;

 private:
  File() = default;
  void parse_all();

  std::unique_ptr<MappedFile> mapping_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  size_t header_bytes_ = 0;
  size_t misaligned_ = 0;
  std::map<std::string, std::string, std::less<>> metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
};

}  // namespace loom::safetensors
