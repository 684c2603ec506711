// Per-row LoRA products of the server's multi-LoRA batches (Backend::lora_rows,
// kernels/backend.h): rows of one step may each use a different adapter.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/backend.h"

namespace loom {

// Two passes, each one parallel dispatch over all jobs and listed rows:
//   u[j, row, :] = scale * (A x[row])        (rank dot products of length in)
//   y[row, n]   += dot(B[n, :], u[j, row, :]) (per column block of 64)
// Adjacent jobs with the same x (the decoder's q/k/v and gate/up) are one
// product in the first pass: a row's A factors of all of them, concatenated,
// in blocks of 4 or 8 over each chunk of x. Rows of one adapter adjacent in
// `rows` are computed together: up to 3 in the first pass (each chunk of A
// read once for them), segments of up to 16 in the second (B's block
// transposed once for 4 or more, columns in the SIMD lanes), whose units go
// segment by segment, so a decode row (a segment of one) reads its B front to
// back. Jobs with stream_factors prefetch the factor bytes the passes read
// next (prefetch_stream.h): decode rows of many adapters read short spans
// from DRAM. Every element is still one fixed sequence of operations
// (ref/lora_rows_ref.h states it), so a row's bits depend neither on the other
// rows, nor on the grouping, nor on the threads. A factor kept in 4 bits
// (LoraFactor::a4 / b4) is read in place (kernels/cpu/int4_dequant.h): a
// tile's A rows 256 columns at a time, and a run's block of B once, are
// dequantized into a stack buffer right before the same operations, so the
// bits are those of the f32 kernel on the unpack_int4_rows values, and no
// f32 copy of an adapter is made. With AVX-512 the codes are unpacked in
// registers instead (lora_rows_avx512f.cpp): every tile's A rows two to a zmm,
// and for short runs (decode rows) B's columns in the lanes (rank 8 or 16, a
// scale per row); the same values and sums, about half the time of the
// buffered form, which had made 4-bit adapters slower than bf16 ones at a
// quarter of the bytes.
// A factor kept in bf16 (a16 / b16) is read
// in place, widened exactly in registers: half the bytes of f32, which is what
// decode rows of many adapters wait for (each row streams its own adapter from
// DRAM); its B is kept in transposed column blocks (kernels/lora_b16.h), so
// every run, one row long too, takes the columns-in-lanes second pass.
// A factor kept in int8 (a8 / b8, kernels/lora_i8.h: B in the same column
// blocks, a scale per row of A and per rank row of a block) is read the same
// way, its codes widened in registers; A's scale multiplies each row's dot
// product, B's scales the u each block sums with (ref/lora_rows_ref.h): a
// quarter of f32's bytes and the arithmetic of bf16 (a multiply per value had
// cost prefill rows 15-40%).
// Rows of one job with one factor, adjacent in the listed rows (at most 16):
// one run of the second pass, whose units go segment by segment.
struct LoraSegment {
  int64_t j, k0, len;  // job, first listed row, rows
  const LoraFactor* f;
  int64_t first_unit, blocks;  // its units: block-major, then row
};
// The segments of the last call, kept so that a serving step allocates
// nothing once warm (the CPU backend's workspace holds one).
struct LoraRowsScratch {
  std::vector<LoraSegment> segments;
};

void lora_rows(ThreadPool& pool, std::span<const LoraRowsJob> jobs, std::span<const int32_t> rows,
               int64_t max_rank, float* u, int64_t T, LoraRowsScratch& scratch);

// K/V rows [T, n_kv_heads * head_dim] into their slots of a paged store
// (kernels/cpu/paged_attention.h layout), as f32 or IEEE half (round to nearest even).
void paged_store(ThreadPool& pool, const AttentionShape& s, void* k_store, void* v_store, DType dtype,
                 int64_t block_size, const float* k, const float* v, const int64_t* slots, int64_t T);

}  // namespace loom
