// Per-row LoRA products of the server's multi-LoRA batches (Backend::lora_rows,
// kernels/backend.h): rows of one step may each use a different adapter.
#pragma once

#include <cstdint>
#include <span>

#include "core/thread_pool.h"
#include "kernels/backend.h"

namespace loom {

// Two passes, each one parallel dispatch over all jobs and listed rows:
//   u[j, row, :] = scale * (A x[row])        (rank dot products of length in, 4 at a time)
//   y[row, n]   += dot(B[n, :], u[j, row, :]) (per column block, 8 at a time)
// Each element is one fixed sequence of operations, so a row's result does not
// depend on the other rows or on the threads. Rows of one adapter should be
// adjacent in `rows` (each run then walks that adapter's A and B once).
void lora_rows(ThreadPool& pool, std::span<const LoraRowsJob> jobs, std::span<const int32_t> rows,
               int64_t max_rank, float* u, int64_t T);

// K/V rows [T, n_kv_heads * head_dim] into their slots of a paged store
// (kernels/cpu/paged_attention.h layout), as f32 or IEEE half (round to nearest even).
void paged_store(ThreadPool& pool, const AttentionShape& s, void* k_store, void* v_store, DType dtype,
                 int64_t block_size, const float* k, const float* v, const int64_t* slots, int64_t T);

}  // namespace loom
