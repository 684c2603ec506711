// A Backend that runs another and records each op as a span of the tracer
// (core/trace.h): its kind, the phase and layer it ran in, rows, a matmul's
// shape and weight type, the FLOPs and bytes the op implies, and how busy the
// thread pool kept its threads. Ops run unchanged; while the tracer is not
// recording an op costs one atomic load more. A decorator rather than hooks in
// every kernel, so that any backend (CPU now, CUDA, an NPU) is profiled alike.
#pragma once

#include <memory>

#include "core/thread_pool.h"
#include "core/trace.h"
#include "kernels/backend.h"

namespace loom {

// `pool`: the pool `inner` computes with (its work-time accounting is on while
// the tracer records). The tracer and pool outlive the backend.
std::unique_ptr<Backend> make_profiling_backend(std::unique_ptr<Backend> inner, Tracer& tracer, ThreadPool& pool);

}  // namespace loom
