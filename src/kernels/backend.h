// The backend seam: every op the decoder, the loss and the optimizer run, as one
// table of virtual functions that a device implements (ggml's backend
// interface, MLX's primitives' eval_cpu / eval_gpu). model/, train/ and serve/
// call only this; kernels/cpu/ implements it for the CPU (the only backend
// built yet). docs/architecture.md, "Backends", says how CUDA (streams, cuBLAS,
// NCCL) and an NPU (Ascend ACL: device, stream, workspace; HCCL) plug in.
//
// Conventions: pointers passed to ops are device memory of the backend's
// device (DeviceBuffer::data(), Tensor::data with a matching Tensor::device);
// shapes are outermost first; [T, n] is T rows of n floats. Every op computes
// each output element in one fixed order, so results do not depend on the
// thread count, and row t of a row-wise op does not depend on the other rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "core/device.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "kernels/blockwise8.h"
#include "kernels/int4_rows.h"
#include "kernels/lora_b16.h"
#include "kernels/lora_i8.h"
#include "kernels/shapes.h"

namespace loom {

// Memory on a backend's device, owned and zero-filled when allocated.
class DeviceBuffer {
 public:
  using FreeFn = void (*)(void* data, size_t bytes);
  DeviceBuffer() = default;
  DeviceBuffer(Device device, void* data, size_t bytes, FreeFn free_fn);
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  Device device() const { return device_; }
  void* data() const { return data_; }
  float* floats() const { return static_cast<float*>(data_); }
  size_t bytes() const { return bytes_; }
  size_t n_floats() const { return bytes_ / sizeof(float); }
  bool empty() const { return bytes_ == 0; }

 private:
  Device device_{};
  void* data_ = nullptr;
  size_t bytes_ = 0;
  FreeFn free_ = nullptr;
};

// A weight matrix a backend has prepared for its products (the CPU: panels of
// kernels/cpu/matmul.h; a GPU: device memory in its GEMM's layout). Made once
// at load by Backend::prepare_weight, read-only afterwards.
class DeviceWeight {
 public:
  virtual ~DeviceWeight() = default;
  virtual Device device() const = 0;
  virtual DType dtype() const = 0;  // as stored on the device
  virtual int64_t rows() const = 0;
  virtual int64_t cols() const = 0;
  virtual size_t nbytes() const = 0;
};
using WeightHandle = std::unique_ptr<DeviceWeight>;

// How a frozen weight's transpose is held for input gradients (see
// kernels/cpu/linear_backward.h): exact dequantizes W tile by tile and needs no
// handle; the others prepare W^T once.
enum class BackwardPrecision { exact, f16, int8, bf16 };

// Per-caller state of a backend: scratch memory (CPU), a stream and library
// handles (CUDA), a stream and workspace (NPU). One per thread that issues ops.
class Workspace {
 public:
  virtual ~Workspace() = default;
  // Scratch memory held now (it grows to the largest op seen, then stays), and
  // the part of it the fused loss holds (train/memory.h's arenas).
  virtual size_t bytes() const { return 0; }
  virtual size_t loss_bytes() const { return 0; }
};

// One output of matmul_multi: y [T, W.rows()] rows ldy apart (< 0: W.rows()).
struct MatmulTarget {
  const DeviceWeight* W;
  float* y;
  int64_t ldy = -1;
};

// One adapted linear of a per-row LoRA product (the server's multi-LoRA):
// y[row] += scale * B (A x[row]) for rows whose factor is set. A and B are
// f32, or both kept in 4 bits (a4 / b4 set, a / b null) or in bf16 (a16 /
// b16): the kernels then read them in place and compute exactly what they
// compute on their values in f32; or in int8 (a8 / b8, kernels/lora_i8.h):
// sums over the codes, the scales applied outside them (ref/lora_rows_ref.h).
struct LoraFactor {
  const float* a = nullptr;  // [rank, in]
  const float* b = nullptr;  // [out, rank]
  int64_t rank = 0, in = 0, out = 0;
  float scale = 1.0f;
  Int4Rows a4{}, b4{};       // [rank, in] and [out, rank] in 4 bits (kernels/int4_rows.h)
  const uint16_t* a16 = nullptr;  // [rank, in] as bf16 bits (a null), read widened (exact)
  const uint16_t* b16 = nullptr;  // [out, rank] as bf16 bits in column blocks (b null; kernels/lora_b16.h)
  const uint8_t* a8 = nullptr;    // [rank, in] in int8 with its scales (a null; kernels/lora_i8.h)
  const uint8_t* b8 = nullptr;    // [out, rank] in int8 column blocks with their scales (b null)
  bool quantized() const { return !a4.empty(); }
  bool bf16() const { return a16 != nullptr; }
  bool int8() const { return a8 != nullptr; }
  // The bytes of A and B as kept (bf16 B with its block padding, 4-bit codes with
  // their scales): what one row's products read.
  double bytes() const {
    const auto r = static_cast<double>(rank), i = static_cast<double>(in), o = static_cast<double>(out);
    if (bf16()) return 2 * (r * i + static_cast<double>(lora_b16_elements(out, rank)));
    if (int8()) return static_cast<double>(lora_a8_bytes(rank, in) + lora_b8_bytes(out, rank));
    if (!quantized()) return 4 * r * (i + o);
    return r * (i + o) / 2 +
           4 * (r * i / static_cast<double>(a4.group) + o * r / static_cast<double>(b4.group));
  }
  // Not plain f32: the kernel widens pieces into a stack buffer before the same FMAs.
  bool packed() const { return quantized() || bf16() || int8(); }
};
struct LoraRowsJob {
  const float* x;
  int64_t ldx;
  float* y;
  int64_t ldy;
  int64_t out;                       // y's width (the widest factor's out)
  const LoraFactor* const* factors;  // [rows.size()]: factor of each listed row, null: not adapted
  // The caller's judgement that the factors are not in cache (a step's adapters
  // exceed the last-level cache): the kernel then prefetches them ahead, which
  // costs time on factors that are (cpu/prefetch_stream.h).
  bool stream_factors = false;
};

// The paged K/V store of one layer (serve/kv_pool.h): [n_blocks][n_kv_heads][block_size][head_dim]
// elements of `dtype` (f32 or f16).
struct PagedKvView {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t block_size = 0;
  DType dtype = DType::f32;
};

// The fused output projection + cross-entropy (kernels/cpu/loss.h).
struct LossOp {
  const Tensor* W = nullptr;               // output projection [V, H] as stored
  const DeviceWeight* W_prepared = nullptr;  // the same, prepared for matmul
  BackwardPrecision precision = BackwardPrecision::exact;  // how dh passes W
  const DeviceWeight* Wt = nullptr;        // W^T for dh (prepare_transposed; null: W read directly)
  const float* h = nullptr;                // [T, H] final-norm output
  const int32_t* labels = nullptr;         // [T], -100 = ignore
  int64_t T = 0;
  float grad_scale = 1.0f;
  float* dh = nullptr;                     // [T, H] +=; null: loss only
  float* dW = nullptr;                     // [V, H] += (a trainable f32 W)
  bool count_correct = false;              // fill LossResult::n_correct (evaluation)
};

// One AdamW update of a run of parameters (torch.optim.AdamW, fp32 arithmetic).
struct AdamWUpdate {
  float keep;       // 1 - lr * weight_decay
  float step_size;  // lr / (1 - beta1^t)
  float w1;         // 1 - beta1
  float b2, w2;     // beta2, 1 - beta2
  float bc2_sqrt;   // sqrt(1 - beta2^t)
  float eps;
};

// AdamW for gradients that arrive sparsely (dist.compression topk): a zero
// gradient means "not sent this step" and leaves m, v and p alone (but for the
// weight decay) while the entry's gap grows; the sum that arrives after a gap
// of a steps is taken as a steps of its mean (m = b1^a m + (1 - b1^a) g/a, v
// likewise), then p takes one step. With every entry arriving every step it is
// adamw_update bit for bit.
struct AdamWLazyUpdate {
  AdamWUpdate step;    // the scalars of a gap of 1
  double beta1, beta2;  // beta^a over a gap of a steps (in double: 1 - beta^a from a float beta is off by 1e-5)
};

// One step of bitsandbytes' blockwise 8-bit AdamW (optim.kind adamw8bit): the
// same scalars as AdamWUpdate plus beta1 (its m = b1 m + w1 g order).
struct Adam8bitUpdate {
  float keep;       // 1 - lr * weight_decay
  float step_size;  // lr / (1 - beta1^t)
  float b1, w1;     // beta1, 1 - beta1
  float b2, w2;     // beta2, 1 - beta2
  float bc2_sqrt;   // sqrt(1 - beta2^t)
  float eps;
};
// A tensor's 8-bit moments: codes [n] and absmax [blockwise8_blocks(n)] each,
// quantized with the signed (m) and unsigned (v) dynamic maps.
struct Adam8bitState {
  uint8_t* m = nullptr;
  float* m_absmax = nullptr;
  uint8_t* v = nullptr;
  float* v_absmax = nullptr;
  const Blockwise8Map* m_map = nullptr;
  const Blockwise8Map* v_map = nullptr;
};

// Which element numbers a dropout's n elements draw from the mask: the n are
// rows of `cols`, row i's elements numbered row_stride * i + first, + 1, ...
// (cols 0: the n numbered 0 .. n-1). Tensor parallel: a rank's columns of a
// wider input draw exactly the mask one process draws for those columns.
struct MaskWindow {
  int64_t cols = 0, row_stride = 0, first = 0;
};

// The largest ops of a training step, for the memory estimate made before the
// first one (train/memory.h): a workspace's scratch depends only on these.
struct WorkspaceShape {
  int64_t rows = 0;                  // tokens of the largest micro-batch
  int64_t max_in = 0, max_out = 0;   // widest input / output of the model's products
  int64_t vocab = 0, hidden = 0;     // the fused loss's output projection
  BackwardPrecision precision = BackwardPrecision::exact;
  bool backward = true;              // false: evaluation only
  AttentionShape attention{};        // the training attention's heads
  int64_t lora_rank = 0;             // LoRA's r (its B's weight gradient is narrow); 0: none
  bool repack = false;               // f32 weights whose W^T is prepared again each step (full fine-tuning)
};

class Tracer;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  // The profiler recording this backend's ops (kernels/profiling_backend.h),
  // for callers to mark phases and layers; null when not profiling.
  virtual Tracer* tracer() { return nullptr; }
  // What one workspace grows to running a step of `s` (Workspace::bytes(),
  // and of it Workspace::loss_bytes()).
  struct WorkspaceBytes {
    size_t total = 0, loss = 0;
  };
  virtual WorkspaceBytes workspace_bytes(const WorkspaceShape& s) const = 0;
  // Grows `ws` at once to what a step of `s` holds of the attention's and the
  // weight gradients' scratch (counted in workspace_bytes), so that no step,
  // the first included, allocates it.
  virtual void reserve_workspace(Workspace& ws, const WorkspaceShape& s) = 0;

  // ---- memory and weights
  virtual DeviceBuffer alloc(size_t bytes) = 0;  // zero-filled
  virtual std::unique_ptr<Workspace> make_workspace() = 0;
  // W {N, K} of any supported dtype. `recycle`: a handle no longer needed whose
  // memory may be reused (weights that training changes, repacked each step).
  // Throws loom::Error naming `name` for an unsupported tensor.
  virtual WeightHandle prepare_weight(const Tensor& W, const char* name, WeightHandle recycle = nullptr) = 0;
  // W^T for input gradients at `p` (not exact); null when the backend reads W
  // itself at that precision (the CPU's bf16 path with AMX). `ws`: scratch for
  // the transposition, kept by a caller that repacks after every update (full
  // fine-tuning: WorkspaceShape::repack); null: allocated for the call.
  virtual WeightHandle prepare_transposed(const Tensor& W, BackwardPrecision p, const char* name,
                                          WeightHandle recycle = nullptr, Workspace* ws = nullptr) = 0;

  // ---- forward
  // y [T, N] (rows ldy apart) = x [T, K] (rows ldx apart) W^T.
  virtual void matmul(Workspace& ws, const DeviceWeight& W, const float* x, int64_t ldx, float* y, int64_t ldy,
                      int64_t T) = 0;
  // The same with a weight that was not prepared (e.g. a LoRA factor being trained).
  virtual void matmul_dense(Workspace& ws, const Tensor& W, const float* x, float* y, int64_t T) = 0;
  // Several weights over the same x (q/k/v, gate/up); each result equals its own matmul.
  virtual void matmul_multi(Workspace& ws, std::span<const MatmulTarget> outs, const float* x, int64_t ldx,
                            int64_t T) = 0;
  // Per-row LoRA over `rows` (indices into [0, T)): u [jobs, T, max_rank] is scratch.
  virtual void lora_rows(Workspace& ws, std::span<const LoraRowsJob> jobs, std::span<const int32_t> rows,
                         int64_t max_rank, float* u, int64_t T) = 0;
  // out [T, n] = x / rms(x) * w; rstd [T] saved when not null. out may alias x.
  virtual void rmsnorm(float* out, float* rstd, const float* x, const float* w, int64_t T, int64_t n,
                       float eps) = 0;
  // cs [T, head_dim] = cos | sin of pos[t] * inv_freq (angles in double).
  virtual void rope_table(const RopeTable& rope, const int32_t* pos, int64_t T, float* cs) = 0;
  // Rotates x [T, n_heads, head_dim] by the angles of cs; inverse: the transpose (RoPE's backward).
  virtual void rope(const RopeTable& rope, const float* cs, float* x, int64_t T, int64_t n_heads,
                    bool inverse) = 0;
  // h [T, F] = silu(gate) * up; h may alias gate.
  virtual void swiglu(float* h, const float* gate, const float* up, int64_t T, int64_t F) = 0;
  // out = a + b over n; out may alias a or b.
  virtual void add(float* out, const float* a, const float* b, int64_t n) = 0;
  // y [T, n] += bias [n] on every row.
  virtual void add_bias(float* y, const float* bias, int64_t T, int64_t n) = 0;
  virtual void scale(float* x, float s, int64_t n) = 0;
  // dst [n] = src rounded to the precision of `to` and kept as f32 (bf16, f16;
  // f32: a copy): the operands of mixed-precision products
  // (kernels/cpu/round_precision.h says how). dst may alias src.
  virtual void round_to(DType to, float* dst, const float* src, int64_t n) = 0;
  // dst [rows, cols] (rows ld_dst floats apart) = src [rows, cols] (rows ld_src apart).
  virtual void copy_2d(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows,
                       int64_t cols) = 0;
  virtual void zero(float* x, int64_t n) = 0;
  // dst [cols, rows] = src [rows, cols]^T.
  virtual void transpose(float* dst, const float* src, int64_t rows, int64_t cols) = 0;
  // out [T, H] = rows tokens[t] of the embedding table, dequantized.
  virtual void embedding(const Tensor& table, const int32_t* tokens, int64_t T, float* out) = 0;
  // Inverted dropout with a counter-based mask: dst = src * mask / (1 - p), the
  // mask a pure function of (seed, step, slot, element number). `window` says
  // which element numbers the n elements draw (default: 0 .. n-1).
  virtual void dropout(float* dst, const float* src, int64_t n, double p, uint64_t seed, uint64_t step,
                       uint64_t slot, MaskWindow window = {}) = 0;
  // Saved activations kept as bf16 (training's activation_dtype: bf16):
  // dst [n] = src rounded to nearest even (kernels/cpu/bf16_rows.h), and back (exact).
  virtual void to_bf16(uint16_t* dst, const float* src, int64_t n) = 0;
  virtual void from_bf16(float* dst, const uint16_t* src, int64_t n) = 0;

  // ---- attention
  // Causal GQA over a contiguous K/V store (row p = position p); query t at
  // pos[t] attends to [seq_start[t] or 0, pos[t]].
  virtual void attention(const AttentionShape& s, const float* q, const KvRows& kv, float* out, int64_t T,
                         const int32_t* pos, const int32_t* seq_start) = 0;
  // dst [n] = src rounded to IEEE half (nearest even): rows into an f16 KV store.
  virtual void to_f16(uint16_t* dst, const float* src, int64_t n) = 0;
  // The same over a paged store, each row through its sequence's block table.
  virtual void paged_attention(const AttentionShape& s, const PagedKvView& kv, const float* q, float* out,
                               int64_t T, const int32_t* pos, const int32_t* const* tables) = 0;
  // k, v [T, KV] rows into their slots of a paged store (f32 or f16).
  virtual void paged_store(const AttentionShape& s, void* k_store, void* v_store, DType dtype, int64_t block_size,
                           const float* k, const float* v, const int64_t* slots, int64_t T) = 0;
  // Training attention over packed rows (no cache), saving lse [T, n_heads].
  virtual void attention_train(Workspace& ws, const AttentionShape& s, float* out, float* lse, const float* q,
                               const float* k, const float* v, int64_t T, const int32_t* seq_start) = 0;
  // dq +=, dk +=, dv +=.
  virtual void attention_backward(Workspace& ws, const AttentionShape& s, float* dq, float* dk, float* dv,
                                  const float* dout, const float* q, const float* k, const float* v,
                                  const float* out, const float* lse, int64_t T, const int32_t* seq_start) = 0;

  // ---- loss and backward
  virtual LossResult cross_entropy(Workspace& ws, const LossOp& op) = 0;
  // dx [T, n] +=, dw [n] += (null: frozen).
  virtual void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                                const float* rstd, int64_t T, int64_t n) = 0;
  // dgate, dup overwritten (may alias gate, up).
  virtual void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                               int64_t n) = 0;
  // dx [T, K] (+)= dy [T, N] W: through Wt (prepare_transposed), or W read
  // directly at `p` (Wt null: exact, or the backend's own bf16 path).
  virtual void linear_backward_input(Workspace& ws, const Tensor& W, const DeviceWeight* Wt, BackwardPrecision p,
                                     const float* dy, float* dx, int64_t T, bool accumulate) = 0;
  // dW [N, K] += dy^T x.
  virtual void linear_backward_weight(Workspace& ws, const float* dy, const float* x, float* dW, int64_t T,
                                      int64_t N, int64_t K) = 0;
  virtual void linear_backward_bias(const float* dy, float* db, int64_t T, int64_t N) = 0;
  virtual void embedding_backward(float* dW, const float* dout, const int32_t* tokens, int64_t T, int64_t vocab,
                                  int64_t H) = 0;

  // ---- optimizer
  virtual void adamw_update(const AdamWUpdate& u, float* p, const float* g, float* m, float* v, size_t n) = 0;
  // gap [n]: steps since the entry's gradient last arrived, minus one
  // (AdamWLazyUpdate); 0 after an arrival.
  virtual void adamw_lazy_update(const AdamWLazyUpdate& u, float* p, const float* g, float* m, float* v, float* gap,
                                 size_t n) = 0;
  // Block-wise 8-bit (kernels/blockwise8.h), bit-equal to bitsandbytes' CPU
  // functions: codes [n], absmax [blockwise8_blocks(n)], blocks from x's start.
  virtual void quantize_blockwise(const Blockwise8Map& map, const float* x, size_t n, uint8_t* codes,
                                  float* absmax) = 0;
  virtual void dequantize_blockwise(const Blockwise8Map& map, const uint8_t* codes, const float* absmax, size_t n,
                                    float* out) = 0;
  // One 8-bit AdamW step of one tensor of n elements: dequantize its moments,
  // update them and p, quantize them again (fused, block by block).
  virtual void adamw8bit_update(const Adam8bitUpdate& u, float* p, const float* g, const Adam8bitState& s,
                                size_t n) = 0;
  // sum of squares in double (gradient norms).
  virtual double sum_squares(const float* x, size_t n) = 0;
};

class ThreadPool;

// The weight types loom multiplies (every backend must take them all, so that
// a file that loads runs on every device): checked when weights are bound.
bool weight_type_supported(DType type);

// The backend for `device`, computing with `pool` (the CPU's threads). Throws
// loom::Error(unsupported) for a device this build has no backend for ("built
// without CUDA").
std::unique_ptr<Backend> make_backend(Device device, ThreadPool& pool);

}  // namespace loom
