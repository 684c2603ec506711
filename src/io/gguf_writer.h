// GGUF v3 writer: metadata in the order it is set, tensor infos, then each
// tensor's data at an aligned offset, streamed to the file one tensor at a
// time (a tensor's bytes are produced when it is written, so a whole model is
// never held in memory) and published atomically (io/file_write.h).
// What it writes reads back with gguf::File and with llama.cpp / gguf-py.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "io/gguf.h"

namespace loom::gguf {

class Writer {
 public:
  // Fills `dst` (exactly the tensor's byte size) with the tensor's data.
  using Fill = std::function<void(uint8_t* dst)>;

  // Sets (or replaces, keeping its place) a metadata value.
  void set(std::string key, Value value);
  void set_string(std::string key, std::string v);
  void set_u32(std::string key, uint32_t v);
  void set_i32(std::string key, int32_t v);
  void set_f32(std::string key, float v);
  void set_bool(std::string key, bool v);
  void set_string_array(std::string key, const std::vector<std::string>& v);
  void erase(std::string_view key);
  const Value* find(std::string_view key) const;

  // Adds a tensor; `shape` is outermost first (loom's order; GGUF stores it
  // reversed). The innermost dimension must be a multiple of the dtype's block
  // size. Throws invalid_input for a duplicate name or a bad shape.
  void add_tensor(std::string name, DType dtype, std::vector<int64_t> shape, Fill fill);

  // Writes the file (temporary file, fsync, rename). Throws io naming `path`.
  void write(const std::string& path) const;

  size_t alignment() const { return alignment_; }
  uint64_t data_bytes() const;  // the tensor data section's size, padding included

 private:
  struct Tensor {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    size_t nbytes;
    uint64_t offset;  // within the data section
    Fill fill;
  };
  std::vector<std::pair<std::string, Value>> kv_;
  std::vector<Tensor> tensors_;
  size_t alignment_ = 32;
  uint64_t next_offset_ = 0;
};

// Copies every metadata value of `src` into `w` (in key order; GGUF readers
// look keys up by name).
void copy_metadata(const File& src, Writer& w);

}  // namespace loom::gguf
