// The CPU's block-wise 8-bit kernels (Backend::quantize_blockwise,
// dequantize_blockwise, adamw8bit_update): blocks of 256 run in parallel, each
// block's arithmetic in AVX2 lanes in the f32 order of kernels/ref/optim8bit_ref,
// so the results are bit-equal to it (and to bitsandbytes) for any thread count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/thread_pool.h"
#include "kernels/backend.h"
#include "kernels/blockwise8.h"

namespace loom {

void quantize_blockwise_cpu(ThreadPool& pool, const Blockwise8Map& map, const float* x, size_t n, uint8_t* codes,
                            float* absmax);
void dequantize_blockwise_cpu(ThreadPool& pool, const Blockwise8Map& map, const uint8_t* codes, const float* absmax,
                              size_t n, float* out);
void adamw8bit_update_cpu(ThreadPool& pool, const Adam8bitUpdate& u, float* p, const float* g,
                          const Adam8bitState& s, size_t n);

}  // namespace loom
