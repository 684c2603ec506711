// Typed errors for API boundaries (files, CLI, HTTP, config). Internal
// invariants use LOOM_ASSERT instead; never rely on an assert to check input.
#pragma once

#include <fmt/format.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace loom {

// diverged: training stopped on non-finite steps (docs/training.md, Faults).
enum class ErrorKind { invalid_input, not_found, unsupported, io, diverged, internal };

const char* error_kind_name(ErrorKind kind);
// The process exit code of an error that ends a command: io 3, diverged 4,
// internal 70, the others (bad input) 1.
int error_exit_code(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }
  // Already told to the user (e.g. a training log record): the app's
  // top-level handler exits with the code without printing it again.
  bool reported() const { return reported_; }
  void set_reported() { reported_ = true; }

 private:
  ErrorKind kind_;
  bool reported_ = false;
};

template <typename... Args>
[[noreturn]] void fail(ErrorKind kind, fmt::format_string<Args...> f, Args&&... args) {
  throw Error(kind, fmt::format(f, std::forward<Args>(args)...));
}

[[noreturn]] void assert_failed(const char* expr, const char* file, int line);

}  // namespace loom

#define LOOM_ASSERT(cond) \
  do { if (!(cond)) ::loom::assert_failed(#cond, __FILE__, __LINE__); } while (0)
