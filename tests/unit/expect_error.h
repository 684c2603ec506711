// expect_error: the call must throw loom::Error of `kind` whose message holds
// every needle (messages are part of the contract: they name file, key, field).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "core/error.h"

namespace loom::test_util {

inline void expect_error(const std::function<void()>& fn, ErrorKind kind, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what() << "\n  missing: " << n;
    return;
  }
  ADD_FAILURE() << "no loom::Error thrown";
}

}  // namespace loom::test_util
