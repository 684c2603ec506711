// GGUF v2/v3 reader over a memory-mapped file. Every count, length, offset,
// dimension and type is validated before use; a bad file raises loom::Error
// naming the file, the key or tensor, and what is wrong.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "core/dtype.h"
#include "core/mapped_file.h"
#include "core/tensor.h"

namespace loom::gguf {

// Limits that keep a hostile file from exhausting the stack or memory (real
// models hold about a million array elements, mostly the vocabulary).
constexpr int kMaxArrayDepth = 8;
constexpr uint64_t kMaxArrayElements = uint64_t{1} << 24;  // summed over all metadata arrays

enum class ValueType : uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
  string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12,
};

const char* value_type_name(ValueType t);

struct Value;
struct Array {
  ValueType element_type = ValueType::u8;
  std::vector<Value> items;
};

// One metadata value. Integers keep their signedness; arrays keep element type.
struct Value {
  ValueType type = ValueType::u8;
  std::variant<uint64_t, int64_t, double, bool, std::string, Array> v;
};

struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  int ndim = 0;
  std::array<int64_t, Tensor::kMaxDims> shape{};  // outermost first (GGUF ne[] reversed)
  uint64_t offset = 0;                             // from the start of the file
  size_t nbytes = 0;                               // rows * row bytes, within the file
  const uint8_t* data = nullptr;                   // into the mapping

  Tensor view() const;  // non-owning view over the mapped bytes
};

// Whether `path` is a file (not a folder) that starts with GGUF's magic: how a reader that takes another
// form too (a PEFT folder, a legacy imatrix) tells them apart before parsing.
bool is_gguf_file(const std::string& path);

class File {
 public:
  // Maps and parses `path`. Throws loom::Error (not_found, io, invalid_input, unsupported).
  static std::unique_ptr<File> open(const std::string& path);
  // Parses an in-memory image (tests, fuzzing); `data` must outlive the File.
  static std::unique_ptr<File> parse(const uint8_t* data, size_t size, const std::string& name);

  const std::string& path() const { return name_; }
  uint32_t version() const { return version_; }
  size_t alignment() const { return alignment_; }
  size_t data_offset() const { return data_offset_; }  // start of the tensor data section

  const std::map<std::string, Value, std::less<>>& metadata() const { return kv_; }
  const Value* find(std::string_view key) const;

  // Typed getters: throw invalid_input "<file>: key '<key>': ..." on a missing
  // key (get_*) or wrong type. opt_* return nullopt when the key is absent.
  std::string get_string(std::string_view key) const;
  uint64_t get_uint(std::string_view key) const;   // any non-negative integer type
  int64_t get_int(std::string_view key) const;     // any integer type
  double get_float(std::string_view key) const;    // f32/f64 (integers accepted)
  bool get_bool(std::string_view key) const;
  std::optional<std::string> opt_string(std::string_view key) const;
  std::optional<uint64_t> opt_uint(std::string_view key) const;
  std::optional<double> opt_float(std::string_view key) const;
  std::optional<bool> opt_bool(std::string_view key) const;
  std::vector<std::string> get_string_array(std::string_view key) const;
  std::vector<float> get_f32_array(std::string_view key) const;
  std::vector<int32_t> get_i32_array(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;

 private:
  File() = default;
  void parse_all();

  std::unique_ptr<MappedFile> mapping_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  size_t data_offset_ = 0;
  std::map<std::string, Value, std::less<>> kv_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

}  // namespace loom::gguf
