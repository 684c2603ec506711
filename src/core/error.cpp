#include "core/error.h"

#include <cstdio>

namespace loom {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::invalid_input: return "invalid input";
    case ErrorKind::not_found: return "not found";
    case ErrorKind::unsupported: return "unsupported";
    case ErrorKind::io: return "I/O error";
    case ErrorKind::diverged: return "diverged";
    case ErrorKind::internal: return "internal error";
  }
  return "error";
}

int error_exit_code(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::io: return 3;
    case ErrorKind::diverged: return 4;
    case ErrorKind::internal: return 70;
    case ErrorKind::invalid_input:
    case ErrorKind::not_found:
    case ErrorKind::unsupported: return 1;
  }
  return 70;
}

void assert_failed(const char* expr, const char* file, int line) {
  std::fprintf(stderr, "loom: internal assertion failed: %s (%s:%d)\n", expr, file, line);
  std::abort();
}

}  // namespace loom
