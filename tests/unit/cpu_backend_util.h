// A thread pool and the CPU backend computing on it, for tests that need a
// Backend (sessions, optimizer, KV pool) without a model loader's setup.
#pragma once

#include <memory>

#include "core/thread_pool.h"
#include "kernels/backend.h"

namespace loom::test_util {

struct CpuBackend {
  explicit CpuBackend(int threads = 1) : pool(threads), backend(make_backend(kCpu, pool)) {}
  ThreadPool pool;
  std::unique_ptr<Backend> backend;
};

}  // namespace loom::test_util
