// Atomic whole-file writes and the FNV-1a checksum (see file_write.h).
#include "io/file_write.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "core/error.h"

namespace loom {

void write_file_atomic(const std::string& path, std::string_view bytes) {
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::filesystem::create_directories(parent, ec);
    if (ec) fail(ErrorKind::io, "{}: cannot create folder {}: {}", path, parent.string(), ec.message());
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) fail(ErrorKind::io, "{}: cannot open {} for writing", path, tmp);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f.flush()) {
      f.close();
      std::remove(tmp.c_str());
      fail(ErrorKind::io, "{}: write failed ({} bytes to {})", path, bytes.size(), tmp);
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    fail(ErrorKind::io, "{}: cannot rename {} over it: {}", path, tmp, ec.message());
  }
}

uint64_t fnv1a64(std::string_view bytes, uint64_t seed) {
  uint64_t h = seed;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace loom
