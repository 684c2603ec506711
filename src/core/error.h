// Typed errors for API boundaries (files, CLI, HTTP, config). Internal
// invariants use LOOM_ASSERT instead; never rely on an assert to check input.
#pragma once

#include <fmt/format.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace loom {

enum class ErrorKind { invalid_input, not_found, unsupported, io, internal };

const char* error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

template <typename... Args>
[[noreturn]] void fail(ErrorKind kind, fmt::format_string<Args...> f, Args&&... args) {
  throw Error(kind, fmt::format(f, std::forward<Args>(args)...));
}

[[noreturn]] void assert_failed(const char* expr, const char* file, int line);

}  // namespace loom

#define LOOM_ASSERT(cond) \
  do { if (!(cond)) ::loom::assert_failed(#cond, __FILE__, __LINE__); } while (0)
