// Internal to the training attention: the problem and task descriptions shared
// by the driver (attention_train.cpp) and the per-ISA tile kernels.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace loom::attn {

// Query rows and key rows per tile. Blocks start at each sample's first row, so
// only the diagonal tile of a (query block, key block) pair needs a causal mask.
constexpr int64_t kBlock = 64;

struct Sample {
  int64_t start = 0;  // first row
  int64_t len = 0;    // rows
  int64_t col = 0;    // column of its first key in the transposed K / V (a multiple of the vector width)
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
  // Keys and values transposed per kv head: [G][d][ldt], zero between samples.
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

// Runs tasks[next++] until none are left; called once on every thread.
using TaskRunner = void (*)(const Problem& p, const Task* tasks, int64_t n_tasks, std::atomic<int64_t>& next);

struct TileKernels {
  int width;  // floats per vector: dp and the sample columns are multiples of it
  TaskRunner run;
};

// 64-byte aligned scratch (defined in attention_train.cpp, baseline ISA).
struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float[], FreeDeleter>;
Buffer alloc_floats(int64_t n);

const TileKernels& tile_kernels_avx2();
const TileKernels& tile_kernels_avx512();

}  // namespace loom::attn
