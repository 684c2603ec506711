// The CPU backend: each op of kernels/backend.h forwards to the kernels of
// kernels/cpu/ (their contracts are in the headers included here).
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "core/huge_page_buffer.h"
#include "core/rng.h"
#include "kernels/cpu/attention_train.h"
#include "kernels/cpu/bf16_rows.h"
#include "kernels/cpu/dequant.h"
#include "kernels/cpu/linear_backward.h"
#include "kernels/cpu/lora_rows.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/ops_backward.h"
#include "kernels/cpu/optim8bit.h"
#include "kernels/cpu/paged_attention.h"
#include "kernels/cpu/round_precision.h"

namespace loom {

namespace {

class CpuWeight final : public DeviceWeight {
 public:
  explicit CpuWeight(PackedWeight p) : packed(std::move(p)) {}
  Device device() const override { return kCpu; }
  DType dtype() const override { return packed.dtype(); }
  int64_t rows() const override { return packed.rows(); }
  int64_t cols() const override { return packed.cols(); }
  size_t nbytes() const override { return packed.nbytes(); }
  PackedWeight packed;
};

size_t scratch_bytes(const PackedBackwardScratch& s) {
  return (s.dy.capacity() + s.prod.capacity()) * sizeof(float) + s.matmul.bytes();
}

struct CpuWorkspace final : Workspace {
  MatmulScratch matmul;
  PackedBackwardScratch backward;
  LossScratch loss;
  AttnTrainScratch attention;  // the training attention's plans, K^T / V^T and tiles
  ScratchFloats weight_grad;   // linear_backward_weight's (the layers' and the loss's dW)
  ScratchFloats repack;        // pack_transposed's slices (W^T of weights repacked every step)
  LoraRowsScratch lora;        // the server's per-row LoRA: its second pass's segments
  size_t bytes() const override {
    return matmul.bytes() + scratch_bytes(backward) + loss.bytes() + attention.bytes() + weight_grad.bytes() +
           repack.bytes() + lora.segments.capacity() * sizeof(LoraSegment);
  }
  size_t loss_bytes() const override { return loss.bytes(); }
};

// MatmulScratch::get's 25% headroom.
size_t grown(size_t bytes) { return bytes + bytes / 4; }

// What linear_backward_input_packed (or the bf16 paths) keeps in a
// PackedBackwardScratch for dy [T, N] -> dx [T, K], accumulating or not.
size_t backward_scratch_bytes(BackwardPrecision p, int64_t T, int64_t N, int64_t K, bool accumulate) {
  const auto t = static_cast<size_t>(T), n = static_cast<size_t>(N), k = static_cast<size_t>(K);
  switch (p) {
    case BackwardPrecision::exact: return 0;
    case BackwardPrecision::bf16: return grown(t * n * 2);                   // dy rounded to bf16 pairs
    case BackwardPrecision::f16: return accumulate ? t * k * sizeof(float) : 0;  // the product before +=
    case BackwardPrecision::int8:  // dy rescaled, quantized to q8_0, the product
      return t * n * sizeof(float) + grown(t * n / 32 * 34) + t * k * sizeof(float);
  }
  return 0;
}

CpuWorkspace& cpu(Workspace& ws) { return static_cast<CpuWorkspace&>(ws); }

TransposedPrecision transposed_precision(BackwardPrecision p) {
  switch (p) {
    case BackwardPrecision::int8: return TransposedPrecision::int8;
    case BackwardPrecision::bf16: return TransposedPrecision::bf16;
    case BackwardPrecision::f16:
    case BackwardPrecision::exact: break;
  }
  return TransposedPrecision::f16;
}

// Columns per unit of SwiGLU: each element's arithmetic (vector body or scalar
// tail of swiglu) then depends on its column only, whatever the row count.
constexpr int64_t kSwigluCols = 256;
// Units a thread takes at least (8192 elements, a few microseconds): a decode
// row's 1536 (SmolLM2) split over two threads took 2.3 us where one took 1.0
// (`loom profile report`, Zen 2), the run's wake-up and wait costing more than
// the half it saved.
constexpr int64_t kSwigluMinUnits = 32;

void free_aligned(void* p, size_t) { std::free(p); }
void free_mapped(void* p, size_t bytes) { unmap_huge_pages(static_cast<uint8_t*>(p), bytes); }

// Large buffers (KV caches, activation arenas) come from mmap: zero pages the
// kernel commits only when first touched, so a budget reserved is not yet memory
// used. In huge pages (THP advice) like the packed weights: a decode step reads
// each sequence's KV blocks as short spans spread over its layer's part of the pool.
constexpr size_t kMapThreshold = size_t{1} << 20;

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(ThreadPool& pool) : pool_(pool) {}

  Device device() const override { return kCpu; }

  WorkspaceBytes workspace_bytes(const WorkspaceShape& s) const override {
    const auto T = static_cast<size_t>(s.rows), V = static_cast<size_t>(s.vocab), H = static_cast<size_t>(s.hidden);
    const size_t C = std::min<size_t>(64, std::max<size_t>(1, T));  // ChunkedLossArgs::chunk_rows
    WorkspaceBytes b;
    // The loss: its rows, a chunk of h, logits and dh, and dlogits through W^T.
    b.loss = T * sizeof(int64_t) + C * (2 * H + V) * sizeof(float) + C * (sizeof(double) + 1);
    if (s.backward) b.loss += backward_scratch_bytes(s.precision, static_cast<int64_t>(C), s.vocab, s.hidden, false);
    // The products: activations quantized once per call (q8_1 blocks of 36 bytes per 32 at most).
    const size_t quant = grown(T * static_cast<size_t>(s.max_in) / 32 * 36);
    size_t bwd = 0;
    if (s.backward)
      bwd = std::max(backward_scratch_bytes(s.precision, s.rows, s.max_out, s.max_in, false),
                     backward_scratch_bytes(s.precision, s.rows, s.max_out, s.hidden, true));
    // Each worker's panels of a weight packed on the fly (the LoRA factors: 4 panels
    // of 16 f32 rows, matmul.cpp's kFlyGroup).
    const size_t fly = static_cast<size_t>(pool_.size()) * grown(4 * 16 * static_cast<size_t>(s.max_in) * sizeof(float));
    b.total = b.loss + quant + bwd + fly + attention_scratch(s).bytes() +
              (weight_grad_floats(s) + repack_floats(s)) * sizeof(float);
    return b;
  }

  void reserve_workspace(Workspace& ws, const WorkspaceShape& s) override {
    attention_train_reserve(cpu(ws).attention, attention_scratch(s));
    cpu(ws).weight_grad.reserve(weight_grad_floats(s));
    cpu(ws).repack.reserve(repack_floats(s));
  }

  DeviceBuffer alloc(size_t bytes) override {
    if (bytes == 0) return {};
    if (bytes >= kMapThreshold) {
      return DeviceBuffer(kCpu, map_huge_pages(bytes), bytes, &free_mapped);
    }
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (p == nullptr) fail(ErrorKind::io, "out of memory allocating {} bytes", bytes);
    std::memset(p, 0, rounded);
    return DeviceBuffer(kCpu, p, bytes, &free_aligned);
  }

  std::unique_ptr<Workspace> make_workspace() override { return std::make_unique<CpuWorkspace>(); }

  // A recycled handle is refilled in place (its panels' memory reused when the size matches).
  WeightHandle prepare_weight(const Tensor& W, const char* name, WeightHandle recycle) override {
    if (!recycle)
      return std::make_unique<CpuWeight>(PackedWeight::pack(W, &pool_, name, nullptr, &weight_arena_));
    PackedWeight& p = static_cast<CpuWeight&>(*recycle).packed;
    p = PackedWeight::pack(W, &pool_, name, &p);
    return recycle;
  }

  WeightHandle prepare_transposed(const Tensor& W, BackwardPrecision p, const char* name, WeightHandle recycle,
                                  Workspace* ws) override {
    LOOM_ASSERT(p != BackwardPrecision::exact);
    // bf16 with AMX: supported weight types need no copy (W is read and
    // dequantized tile by tile).
    if (p == BackwardPrecision::bf16 && bf16_direct_available(W.dtype)) return nullptr;
    ScratchFloats* scratch = ws ? &cpu(*ws).repack : nullptr;
    const std::span<const Tensor> parts(&W, 1);
    if (!recycle)
      return std::make_unique<CpuWeight>(pack_transposed(pool_, parts, transposed_precision(p), name, nullptr, scratch));
    PackedWeight& old = static_cast<CpuWeight&>(*recycle).packed;
    old = pack_transposed(pool_, parts, transposed_precision(p), name, &old, scratch);
    return recycle;
  }

  void matmul(Workspace& ws, const DeviceWeight& W, const float* x, int64_t ldx, float* y, int64_t ldy,
              int64_t T) override {
    loom::matmul(pool_, cpu_packed(W), x, ldx, y, ldy, T, cpu(ws).matmul);
  }

  void matmul_dense(Workspace& ws, const Tensor& W, const float* x, float* y, int64_t T) override {
    loom::matmul(pool_, W, x, y, T, cpu(ws).matmul);
  }

  void matmul_multi(Workspace& ws, std::span<const MatmulTarget> outs, const float* x, int64_t ldx,
                    int64_t T) override {
    LOOM_ASSERT(outs.size() <= 16);
    MatmulOut o[16];
    for (size_t i = 0; i < outs.size(); ++i) o[i] = {&cpu_packed(*outs[i].W), outs[i].y, outs[i].ldy};
    loom::matmul_multi(pool_, std::span<const MatmulOut>(o, outs.size()), x, ldx, T, cpu(ws).matmul);
  }

  void lora_rows(Workspace& ws, std::span<const LoraRowsJob> jobs, std::span<const int32_t> rows,
                 int64_t max_rank, float* u, int64_t T) override {
    loom::lora_rows(pool_, jobs, rows, max_rank, u, T, cpu(ws).lora);
  }

  void rmsnorm(float* out, float* rstd, const float* x, const float* w, int64_t T, int64_t n, float eps) override {
    pool_.parallel_for(
        T,
        [&](int64_t b, int64_t e) {
          if (rstd != nullptr)
            rmsnorm_forward_train(out + b * n, rstd + b, x + b * n, w, e - b, n, eps);
          else
            loom::rmsnorm(out + b * n, x + b * n, w, e - b, n, eps);
        },
        8);
  }

  void rope_table(const RopeTable& rope, const int32_t* pos, int64_t T, float* cs) override {
    const int64_t d = rope.head_dim, half = d / 2;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < half; ++j) {
        // angle in double: positions up to 1e5+ times small frequencies lose bits in float
        const double a = static_cast<double>(pos[t]) * rope.inv_freq[static_cast<size_t>(j)];
        cs[t * d + j] = static_cast<float>(std::cos(a));
        cs[t * d + half + j] = static_cast<float>(std::sin(a));
      }
  }

  void rope(const RopeTable& rope, const float* cs, float* x, int64_t T, int64_t n_heads, bool inverse) override {
    const int64_t d = rope.head_dim, half = d / 2;
    const bool inter = rope.interleaved;
    pool_.parallel_for(
        T,
        [&](int64_t b, int64_t e) {
          for (int64_t t = b; t < e; ++t) {
            const float* c_s = cs + t * d;
            for (int64_t h = 0; h < n_heads; ++h) {
              float* v = x + (t * n_heads + h) * d;
              for (int64_t i = 0; i < half; ++i) {
                const int64_t i0 = inter ? 2 * i : i, i1 = inter ? 2 * i + 1 : i + half;
                // The inverse rotation negates the sine (an exact sign flip).
                const float c = c_s[i], s = inverse ? -c_s[half + i] : c_s[half + i];
                const float x0 = v[i0], x1 = v[i1];
                v[i0] = x0 * c - x1 * s;
                v[i1] = x0 * s + x1 * c;
              }
            }
          }
        },
        4);
  }

  void swiglu(float* h, const float* gate, const float* up, int64_t T, int64_t F) override {
    const int64_t nb = (F + kSwigluCols - 1) / kSwigluCols;
    pool_.parallel_for(
        T * nb,
        [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) {
            const int64_t t = i / nb, c0 = (i % nb) * kSwigluCols, n = std::min(kSwigluCols, F - c0);
            loom::swiglu(h + t * F + c0, gate + t * F + c0, up + t * F + c0, n);
          }
        },
        kSwigluMinUnits);
  }

  void add(float* out, const float* a, const float* b, int64_t n) override {
    if (out == a) {
      add_inplace(out, b, n);
    } else if (out == b) {
      add_inplace(out, a, n);  // IEEE addition commutes: the same bits as a + b
    } else {
      std::memcpy(out, a, static_cast<size_t>(n) * sizeof(float));
      add_inplace(out, b, n);
    }
  }

  void add_bias(float* y, const float* bias, int64_t T, int64_t n) override {
    for (int64_t t = 0; t < T; ++t) add_inplace(y + t * n, bias, n);
  }

  void scale(float* x, float s, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) x[i] *= s;
  }

  void round_to(DType to, float* dst, const float* src, int64_t n) override {
    constexpr int64_t kChunk = 16384;  // elements are rounded alone: any split gives the same bits
    if (n <= kChunk) return round_to_precision(to, dst, src, n);
    pool_.parallel_for((n + kChunk - 1) / kChunk, [&](int64_t b, int64_t e) {
      const int64_t i0 = b * kChunk, i1 = std::min(n, e * kChunk);
      round_to_precision(to, dst + i0, src + i0, i1 - i0);
    });
  }

  void zero(float* x, int64_t n) override { std::memset(x, 0, static_cast<size_t>(n) * sizeof(float)); }

  void transpose(float* dst, const float* src, int64_t rows, int64_t cols) override {
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t j = 0; j < cols; ++j) dst[j * rows + n] = src[n * cols + j];
  }

  void embedding(const Tensor& table, const int32_t* tokens, int64_t T, float* out) override {
    const int64_t H = table.cols();
    for (int64_t t = 0; t < T; ++t) dequantize_row(table.dtype, table.row_ptr(tokens[t]), out + t * H, H);
  }

  void dropout(float* dst, const float* src, int64_t n, double p, uint64_t seed, uint64_t step, uint64_t slot,
               MaskWindow w) override {
    const uint64_t stream = seed ^ splitmix64(step * 0x9e3779b97f4a7c15ull + slot + 1);
    const auto keep_scale = static_cast<float>(1.0 / (1.0 - p));
    const int64_t cols = w.cols > 0 ? w.cols : n;
    LOOM_ASSERT(n == 0 || (n % cols == 0 && (w.cols == 0 || w.first + cols <= w.row_stride)));
    for (int64_t i = 0; i * cols < n; ++i) {  // a row's draws continue the counter at its first number
      CounterRng rng(stream, static_cast<uint64_t>(w.cols > 0 ? i * w.row_stride + w.first : 0));
      for (int64_t j = i * cols; j < (i + 1) * cols; ++j) dst[j] = rng.next_double() < p ? 0.0f : src[j] * keep_scale;
    }
  }

  void copy_2d(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t cols) override {
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(dst + i * ld_dst, src + i * ld_src, static_cast<size_t>(cols) * sizeof(float));
  }

  void to_bf16(uint16_t* dst, const float* src, int64_t n) override {
    constexpr int64_t kChunk = 16384;  // elements convert alone: any split gives the same bits
    pool_.parallel_for((n + kChunk - 1) / kChunk, [&](int64_t b, int64_t e) {
      const int64_t i0 = b * kChunk, i1 = std::min(n, e * kChunk);
      f32_to_bf16_rows(dst + i0, src + i0, i1 - i0);
    });
  }

  void from_bf16(float* dst, const uint16_t* src, int64_t n) override {
    constexpr int64_t kChunk = 16384;
    pool_.parallel_for((n + kChunk - 1) / kChunk, [&](int64_t b, int64_t e) {
      const int64_t i0 = b * kChunk, i1 = std::min(n, e * kChunk);
      bf16_to_f32_rows(dst + i0, src + i0, i1 - i0);
    });
  }

  void attention(const AttentionShape& s, const float* q, const KvRows& kv, float* out, int64_t T,
                 const int32_t* pos, const int32_t* seq_start) override {
    loom::attention(pool_, s, q, kv, out, T, pos, seq_start);
  }

  void to_f16(uint16_t* dst, const float* src, int64_t n) override { store_f16(dst, src, n); }

  void paged_attention(const AttentionShape& s, const PagedKvView& kv, const float* q, float* out, int64_t T,
                       const int32_t* pos, const int32_t* const* tables) override {
    const PagedKv p{kv.k, kv.v, kv.block_size, kv.dtype};
    loom::paged_attention(pool_, s, p, q, out, T, pos, tables);
  }

  void paged_store(const AttentionShape& s, void* k_store, void* v_store, DType dtype, int64_t block_size,
                   const float* k, const float* v, const int64_t* slots, int64_t T) override {
    loom::paged_store(pool_, s, k_store, v_store, dtype, block_size, k, v, slots, T);
  }

  void attention_train(Workspace& ws, const AttentionShape& s, float* out, float* lse, const float* q,
                       const float* k, const float* v, int64_t T, const int32_t* seq_start) override {
    attention_forward_train(pool_, AttnTrainOptions{}, out, lse, q, k, v, s, T, seq_start, cpu(ws).attention);
  }

  void attention_backward(Workspace& ws, const AttentionShape& s, float* dq, float* dk, float* dv,
                          const float* dout, const float* q, const float* k, const float* v, const float* out,
                          const float* lse, int64_t T, const int32_t* seq_start) override {
    loom::attention_backward(pool_, AttnTrainOptions{}, dq, dk, dv, dout, q, k, v, out, lse, s, T, seq_start,
                             cpu(ws).attention);
  }

  LossResult cross_entropy(Workspace& ws, const LossOp& op) override {
    ChunkedLossArgs a;
    a.W = op.W;
    a.W_packed = op.W_prepared ? &cpu_packed(*op.W_prepared) : nullptr;
    a.Wt_packed = op.precision == BackwardPrecision::exact ? nullptr
                  : op.Wt != nullptr                       ? &cpu_packed(*op.Wt)
                                                           : &read_w_directly_;
    a.h = op.h;
    a.labels = op.labels;
    a.T = op.T;
    a.grad_scale = op.grad_scale;
    a.dh = op.dh;
    a.dW = op.dW;
    a.dW_scratch = &cpu(ws).weight_grad;
    a.count_correct = op.count_correct;
    return chunked_cross_entropy(pool_, a, cpu(ws).matmul, &cpu(ws).loss);
  }

  void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                        const float* rstd, int64_t T, int64_t n) override {
    loom::rmsnorm_backward(dx, dw, dout, x, w, rstd, T, n);
  }

  void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                       int64_t n) override {
    loom::swiglu_backward(dgate, dup, dout, gate, up, n);
  }

  void linear_backward_input(Workspace& ws, const Tensor& W, const DeviceWeight* Wt, BackwardPrecision p,
                             const float* dy, float* dx, int64_t T, bool accumulate) override {
    PackedBackwardScratch& scratch = cpu(ws).backward;
    if (p == BackwardPrecision::exact) {
      if (!accumulate) zero(dx, T * W.cols());
      loom::linear_backward_input(pool_, W, dy, dx, T);
    } else if (Wt == nullptr) {
      LOOM_ASSERT(p == BackwardPrecision::bf16);
      linear_backward_input_bf16_direct(pool_, W, dy, W.rows(), dx, T, accumulate, scratch);
    } else {
      linear_backward_input_packed(pool_, cpu_packed(*Wt), dy, W.rows(), dx, T, accumulate, scratch);
    }
  }

  void linear_backward_weight(Workspace& ws, const float* dy, const float* x, float* dW, int64_t T, int64_t N,
                              int64_t K) override {
    loom::linear_backward_weight(pool_, dy, x, dW, T, N, K, cpu(ws).weight_grad);
  }

  void linear_backward_bias(const float* dy, float* db, int64_t T, int64_t N) override {
    loom::linear_backward_bias(dy, db, T, N);
  }

  void embedding_backward(float* dW, const float* dout, const int32_t* tokens, int64_t T, int64_t vocab,
                          int64_t H) override {
    loom::embedding_backward(pool_, dW, dout, tokens, T, vocab, H);
  }

  void adamw_update(const AdamWUpdate& u, float* p, const float* g, float* m, float* v, size_t n) override {
    for (size_t i = 0; i < n; ++i) {
      p[i] *= u.keep;                              // decoupled weight decay
      m[i] = m[i] + u.w1 * (g[i] - m[i]);          // exp_avg.lerp_(grad, 1 - beta1)
      v[i] = v[i] * u.b2 + u.w2 * (g[i] * g[i]);   // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
      const float denom = std::sqrt(v[i]) / u.bc2_sqrt + u.eps;
      p[i] = p[i] - u.step_size * (m[i] / denom);
    }
  }

  // b^a by squaring (std::pow's general case costs more than the rest of an entry's update).
  static double integer_power(double b, uint64_t a) {
    double r = 1.0;
    for (; a; a >>= 1, b *= b)
      if (a & 1) r *= b;
    return r;
  }

  // Scalar, as adamw_update: one pass over the arena a step.
  void adamw_lazy_update(const AdamWLazyUpdate& u, float* p, const float* g, float* m, float* v, float* gap,
                         size_t n) override {
    const AdamWUpdate& s = u.step;
    for (size_t i = 0; i < n; ++i) {
      p[i] *= s.keep;
      if (g[i] == 0.0f) {  // not sent this step
        gap[i] += 1.0f;
        continue;
      }
      float w1 = s.w1, b2 = s.b2, w2 = s.w2, gi = g[i];
      if (gap[i] > 0.0f) {  // the sum of a = gap + 1 steps: a steps of its mean
        const auto a = static_cast<uint64_t>(gap[i]) + 1;
        const double b1a = integer_power(u.beta1, a), b2a = integer_power(u.beta2, a);
        w1 = static_cast<float>(1.0 - b1a);
        b2 = static_cast<float>(b2a);
        w2 = static_cast<float>(1.0 - b2a);
        gi = static_cast<float>(static_cast<double>(g[i]) / static_cast<double>(a));
        gap[i] = 0.0f;
      }
      m[i] = m[i] + w1 * (gi - m[i]);
      v[i] = v[i] * b2 + w2 * (gi * gi);
      const float denom = std::sqrt(v[i]) / s.bc2_sqrt + s.eps;
      p[i] = p[i] - s.step_size * (m[i] / denom);
    }
  }

  void quantize_blockwise(const Blockwise8Map& map, const float* x, size_t n, uint8_t* codes,
                          float* absmax) override {
    quantize_blockwise_cpu(pool_, map, x, n, codes, absmax);
  }

  void dequantize_blockwise(const Blockwise8Map& map, const uint8_t* codes, const float* absmax, size_t n,
                            float* out) override {
    dequantize_blockwise_cpu(pool_, map, codes, absmax, n, out);
  }

  void adamw8bit_update(const Adam8bitUpdate& u, float* p, const float* g, const Adam8bitState& s,
                        size_t n) override {
    adamw8bit_update_cpu(pool_, u, p, g, s, n);
  }

  double sum_squares(const float* x, size_t n) override {
    double s = 0;
    for (size_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
    return s;
  }

 private:
  // The training attention's scratch for a step of `s` (any split of its rows into samples).
  AttnTrainScratchSize attention_scratch(const WorkspaceShape& s) const {
    if (s.attention.n_heads <= 0) return {};
    return attention_train_scratch_size(s.attention, s.rows, pool_.size(), s.backward);
  }
  // linear_backward_weight's largest call of a step: dW of a layer's weight
  // (the loss's dW chunks have fewer rows), or LoRA's narrow B [max_out, r].
  size_t weight_grad_floats(const WorkspaceShape& s) const {
    if (!s.backward) return 0;
    return std::max(linear_backward_weight_floats(s.rows, s.max_out, s.max_in, pool_.size()),
                    linear_backward_weight_floats(s.rows, s.max_out, s.lora_rank, pool_.size()));
  }

  // pack_transposed's scratch for the largest f32 weight repacked each step (the
  // output projection's vocab rows, or the layers' widest).
  size_t repack_floats(const WorkspaceShape& s) const {
    const BackwardPrecision p = s.precision;
    if (!s.repack || p == BackwardPrecision::exact || (p == BackwardPrecision::bf16 && bf16_direct_available(DType::f32)))
      return 0;
    const int64_t q = s.attention.n_heads * s.attention.head_dim, kv = s.attention.n_kv_heads * s.attention.head_dim;
    size_t n = 0;
    for (int64_t N : {s.vocab, s.hidden, q, kv, s.max_in, s.max_out})
      n = std::max(n, pack_transposed_floats(DType::f32, N, s.hidden, transposed_precision(p), pool_.size()));
    return n;
  }

  ThreadPool& pool_;
  // Weights packed at load, in huge pages: a decoded token streams all of them
  // (repacks with a new size go to the heap: the arena does not reuse pieces).
  HugePageArena weight_arena_;
  const PackedWeight read_w_directly_;  // an empty W^T: the loss's bf16 products read W itself
};

}  // namespace

const PackedWeight& cpu_packed(const DeviceWeight& w) {
  LOOM_ASSERT(w.device().is_cpu());
  return static_cast<const CpuWeight&>(w).packed;
}

std::unique_ptr<Backend> make_cpu_backend(ThreadPool& pool) { return std::make_unique<CpuBackend>(pool); }

}  // namespace loom
