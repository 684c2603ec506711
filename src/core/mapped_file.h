// Read-only memory mapping of a whole file (model weights stay on disk pages
// until touched). Errors name the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace loom {

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Reads a whole (small) file into a string; throws not_found / io (invalid_input
// for a directory) naming it.
std::string read_text_file(const std::string& path);

}  // namespace loom
