// Internal to the training attention: the problem and task descriptions shared
// by the driver (attention_train.cpp) and the per-ISA tile kernels.
#pragma once

#include <atomic>
#include <cstdint>

namespace loom::attn {

// Query rows and key rows per tile. Blocks start at each sample's first row, so
// only the diagonal tile of a (query block, key block) pair needs a causal mask.
constexpr int64_t kBlock = 64;

struct Sample {
  int64_t start = 0;  // first row
  int64_t len = 0;    // rows
  // Column of its first key in the transposed K / V: a multiple of the vector
  // width W for samples of W rows or more; shorter ones (the one-row samples
  // of padding) sit right after the previous sample, unaligned, so padding
  // costs a column a row, not W. A tile reads at most its keys rounded up to
  // W columns: columns past a sample's keys hold another sample's (finite) keys
  // or zeros, and every lane past the sample's keys is masked.
  int64_t col = 0;
};

// Row-major operand: row t of head h at base + t * ld + h * hs.
struct Rows {
  const float* base = nullptr;
  int64_t ld = 0;
  int64_t hs = 0;
  const float* at(int64_t t, int64_t h) const { return base + t * ld + h * hs; }
};

struct Problem {
  int64_t d = 0;   // head_dim
  int64_t dp = 0;  // head_dim rounded up to the vector width (== d unless the rows were padded)
  int64_t H = 0, group = 0;
  float scale = 0;  // 1 / sqrt(d)
  const Sample* samples = nullptr;
  // Inputs with dp readable columns per head (zero-padded copies when dp != d).
  Rows q, k, v, dout;
  // Keys and values transposed per kv head: [G][d][ldt] (see Sample::col).
  const float* kt = nullptr;
  const float* vt = nullptr;  // backward only
  int64_t ldt = 0;
  // Forward outputs: out row t, head h at out + t * H * d + h * d; lse [T, H].
  float* out = nullptr;
  float* lse = nullptr;
  // Backward: saved lse and D = rowsum(dout * out), both [T, H]; gradients in the
  // callers' layouts (dq like q, dk / dv rows of kv_stride).
  const float* lse_in = nullptr;
  const float* D = nullptr;
  float* dq = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
  int64_t kv_stride = 0;
  int64_t dkdv_rows = 0;  // rows of each thread's dk / dv accumulators (backward)
};

enum class TaskKind : int32_t {
  forward,  // head = query head, block = query block
  fused,    // head = kv head: dk, dv of the sample and dq of the group's query heads
  dkdv,     // head = kv head, block = key block
  dq,       // head = query head, block = query block
};

struct Task {
  TaskKind kind = TaskKind::forward;
  int32_t sample = 0;
  int32_t head = 0;
  int32_t block = 0;
};

// A task with its planned cost and its place in the order it was made (the
// tie-break that makes an in-place sort by cost stable).
struct PlannedTask {
  Task task;
  double cost = 0;
  int64_t seq = 0;
};

// Rows [row, row + n) of K or V into columns [col, col + width) of the
// transposed copy (columns past n are zeroed).
struct PackBlock {
  int64_t row = 0, col = 0, n = 0, width = 0;
};

// One thread's tiles (attention_train_kernels.h's Workspace): two score tiles,
// a dp-wide row tile, per-lane row sums and, in the backward, dk / dv
// accumulators of `dkdv_rows` rows.
inline int64_t tile_floats(int64_t dp, int64_t width, int64_t dkdv_rows) {
  auto lines = [](int64_t n) { return (n + 15) / 16 * 16; };
  return 2 * lines(kBlock * kBlock) + lines(kBlock * dp) + lines(kBlock * width) + 2 * lines(dkdv_rows * dp);
}

// Runs tasks[next++] until none are left; called once for every thread index,
// `tiles` that index's tile_floats() (64-byte aligned).
using TaskRunner = void (*)(const Problem& p, const Task* tasks, int64_t n_tasks, std::atomic<int64_t>& next,
                            float* tiles);

struct TileKernels {
  int width;  // floats per vector: dp and the sample columns are multiples of it
  TaskRunner run;
};

const TileKernels& tile_kernels_avx2();
const TileKernels& tile_kernels_avx512();

}  // namespace loom::attn
