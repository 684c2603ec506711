// The CPU implementation of the Backend op table (kernels/backend.h): the
// AVX2 / AVX-512 / AMX kernels of kernels/cpu/, run on a ThreadPool.
#pragma once

#include <memory>

#include "core/thread_pool.h"
#include "kernels/backend.h"
#include "kernels/cpu/matmul.h"

namespace loom {

std::unique_ptr<Backend> make_cpu_backend(ThreadPool& pool);

// The panels behind a weight the CPU backend prepared (tests and benchmarks
// that call the CPU kernels directly).
const PackedWeight& cpu_packed(const DeviceWeight& w);

}  // namespace loom
