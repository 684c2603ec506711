#include "core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace loom {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    fail(e == ENOENT ? ErrorKind::not_found : ErrorKind::io, "{}: cannot open: {}", path, std::strerror(e));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(ErrorKind::io, "{}: not a regular file", path);
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      fail(ErrorKind::io, "{}: mmap failed: {}", path, std::strerror(e));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

std::string read_text_file(const std::string& path) {
  std::error_code ec;  // an ifstream "reads" a folder as empty
  if (std::filesystem::is_directory(path, ec)) fail(ErrorKind::invalid_input, "{}: is a directory, not a file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorKind::not_found, "{}: cannot open file", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail(ErrorKind::io, "{}: read error", path);
  return ss.str();
}

}  // namespace loom
