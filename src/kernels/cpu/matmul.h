// Matrix products y = x W^T of f32 activations with weights of any GGUF type
// (f32, f16, bf16, q4_0 .. q8_0, q2_k .. q6_k, nf4, i8_ch): the op that decides inference speed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/dtype.h"
#include "core/huge_page_buffer.h"
#include "core/range_claims.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace loom {

// How the kernels work, and what that guarantees:
//
// Weights are used in "panels": 16 consecutive rows of W interleaved so that one
// vector lane holds one output row (lane n computes y[t, n0 + n]). Quantized types
// keep their quants and scales (about the GGUF size: +3% q4_k/q5_k, +4% q3_k,
// +19% q2_k); f16/bf16/f32 keep their element type (bf16 in column pairs). Activations are quantized once
// per call the way llama.cpp does it (q8_0 for q4_0/q5_0/q8_0, q8_1 for q4_1/q5_1,
// q8_K for the k-quants; bit-identical to kernels/ref/dequant_ref.h) and each
// block's integer dot product is exact (vpdpbusd on AVX-512, vpmaddubsw on AVX2,
// AMX-INT8 tiles for batches of >= 8 tokens of q4_0/q4_1/q5_0/q5_1/q8_0 where the
// CPU has them); f16/f32 weights use f32 activations and f32 FMA; bf16 weights
// take activations rounded to bf16 (as llama.cpp and PyTorch's bf16 do) and
// multiply pairs with vdpbf16ps where the CPU has AVX512-BF16 (twice the f32
// FMA's products per instruction), else emulate it exactly with f32 FMAs.
//
// Every output element is one fixed sequence of float operations over the K axis:
//   32-blocks: acc = fma(float(idot), d_w * d_x, acc); q4_1/q5_1 then
//              acc = fma(m_w, s_x, acc)   (idot includes the -8/-16 offsets)
//   q4_k/q5_k: per 256: acc = fma(float(sum_g sc_g idot_g), d * d_x, acc);
//              acc = fma(-float(sum_g m_g xsum_g), dmin * d_x, acc)
//   q6_k/q3_k: per 256: acc = fma(float(sum_j sc_j idot_j), d * d_x, acc)
//   q2_k:      as q6_k, then acc = fma(-float(sum_j m_j xsum_j), dmin * d_x, acc)
//   f32 / f16: acc = fma(w[k], x[k], acc) for k = 0, 1, ...
//   bf16:      per pair j = 0, 1, ...: acc = fma(w[2j+1], xb[2j+1], acc), then
//              acc = fma(w[2j], xb[2j], acc) (xb: x rounded to bf16, subnormals to
//              zero; a zero column pads odd K; denormals as zero, as vdpbf16ps)
//   nf4:       per 64: s = fma chain of code[q_k] * x[k] from 0, then
//              acc = fma(s, absmax, acc)   (f32 activations; kernels/cpu/nf4.h)
//   i8_ch:     x quantized per row (one int8 scale per token), the exact int32
//              acc = sum_k q_k qx_k - zero * xsum over the whole row, then
//              y = float(acc) * (scale * s_x)   (kernels/ref/i8ch_ref.h; K <= 65536)
// Hence results are
//  - deterministic: independent of the thread count (threads split output rows);
//  - batch invariant: row t of y is bit-identical whether computed with T = 1 or in
//    any batch, and whether W is a Tensor or a PackedWeight;
//  - identical on the AVX2, AVX-512 and AMX paths (they differ only in the order
//    of exact integer adds; for bf16, vdpbf16ps vs its emulation, measured equal
//    on AMD Zen 4 and tested bit for bit wherever the tests run).
// They differ from the exact product of dequantized W with x by the activation
// rounding (sum_k |w_k| |x_k - xq_k| <= sum_k |w_k| d_x(k) / 2 for the q8 types,
// sum_k |w_k| |x_k| 2^-9 for bf16, plus |m_w| |s - d_x sum(qs)| per q4_1/q5_1
// block) plus f32 rounding.
//
// LOOM_CPU=avx2 selects the AVX2 kernels, LOOM_CPU=avx512 AVX-512 without AMX.

// 64-byte aligned heap memory.
struct AlignedFree {
  void operator()(uint8_t* p) const;
};
using AlignedBytes = std::unique_ptr<uint8_t, AlignedFree>;
AlignedBytes alloc_aligned(size_t bytes);

// How a PackedWeight's bytes are arranged: `panels` for matmul (above); or
// `bf16_pairs`, W^T for bf16 input gradients (kernels/cpu/bf16_gemm.h), which
// only linear_backward_input_packed reads (matmul rejects it).
enum class PackedLayout : uint8_t { panels, bf16_pairs };

// A weight matrix rearranged once into panels (see above). Owns its memory; the
// source tensor may be released afterwards. Use it for every weight that is
// multiplied more than once: matmul() on a plain Tensor repacks panels on the fly
// each call, which costs several times the product itself at T = 1.
class PackedWeight {
 public:
  PackedWeight() = default;
  PackedWeight(PackedWeight&&) = default;
  PackedWeight& operator=(PackedWeight&&) = default;
  PackedWeight(const PackedWeight&) = delete;  // owns its panels (one writer)
  PackedWeight& operator=(const PackedWeight&) = delete;
  // W: {N, K} (or any tensor viewed as rows() x cols()) of a supported dtype.
  // Throws loom::Error(unsupported / invalid_input) naming `name` for a bad tensor.
  // `recycle`: a PackedWeight no longer needed whose memory is reused when it has
  // the same size (repacking weights that training changed, without page faults).
  // `arena`: where new panels are carved (huge pages: weights packed at load, read
  // once per decoded token); null: the heap.
  static PackedWeight pack(const Tensor& W, ThreadPool* pool = nullptr, const char* name = "weight",
                           PackedWeight* recycle = nullptr, HugePageArena* arena = nullptr);
  // Stacks the rows of several tensors of one dtype and width (e.g. Wq, Wk, Wv, or
  // Wgate, Wup) into one matrix, so one matmul call computes all of them: y row t
  // is then [x Wq^T | x Wk^T | x Wv^T]. Saves a thread dispatch and an activation
  // quantization per extra tensor.
  static PackedWeight pack_concat(std::span<const Tensor> parts, ThreadPool* pool = nullptr,
                                  const char* name = "weight", PackedWeight* recycle = nullptr,
                                  HugePageArena* arena = nullptr);

  // Uninitialised storage of n_panels(rows) panels of `panel_bytes` for a packer
  // of another layout to fill (through mutable_panel); `recycle`, `arena` as for pack.
  static PackedWeight allocate(PackedLayout layout, DType dtype, int64_t rows, int64_t cols,
                               size_t panel_bytes, PackedWeight* recycle = nullptr,
                               HugePageArena* arena = nullptr);

  PackedLayout layout() const { return layout_; }
  DType dtype() const { return dtype_; }  // the panels' (cpu::matmul_panel_type of the packed tensors')
  int64_t rows() const { return n_; }
  int64_t cols() const { return k_; }
  bool empty() const { return n_ == 0; }
  size_t nbytes() const { return n_panels_ * panel_bytes_; }

  // Internal layout (used by the kernels).
  const uint8_t* panel(int64_t p) const { return data_.get() + static_cast<size_t>(p) * panel_bytes_; }
  size_t panel_bytes() const { return panel_bytes_; }
  int64_t n_panels() const { return static_cast<int64_t>(n_panels_); }
  uint8_t* mutable_panel(int64_t p) { return data_.get() + static_cast<size_t>(p) * panel_bytes_; }

 private:
  std::shared_ptr<uint8_t> data_;  // owns heap bytes, or points into an arena chunk it keeps alive
  PackedLayout layout_ = PackedLayout::panels;
  DType dtype_ = DType::f32;
  int64_t n_ = 0, k_ = 0;
  size_t n_panels_ = 0, panel_bytes_ = 0;
};

// Bytes between the panels of a PackedWeight of `type` with K columns (for a
// packer that fills PackedWeight::allocate's panels itself with cpu::pack_panel).
size_t packed_panel_stride(DType type, int64_t K);

// Reusable working memory for matmul (quantized activations, on-the-fly panels).
// One per calling thread (e.g. per model instance); grows as needed, never shrinks.
class MatmulScratch {
 public:
  MatmulScratch() = default;
  // Returns a 64-byte aligned region of at least `bytes` for slot `slot`
  // (slot 0: activations; slot 1 + i: worker i's panels).
  uint8_t* get(size_t slot, size_t bytes);
  // The current region of a slot that get() has grown (safe to call from workers).
  uint8_t* ptr(size_t slot) const { return bufs_[slot].ptr.get(); }
  size_t bytes() const;  // allocated, all slots
  // The panel split's work claims of the current call (set up before workers run).
  RangeClaims& claims() { return claims_; }

 private:
  struct Buf {
    AlignedBytes ptr;
    size_t size = 0;
  };
  std::vector<Buf> bufs_;
  RangeClaims claims_;
};

// y[t*ldy + n] = sum_k x[t*ldx + k] * W[n, k]   for t < T, n < N.
// x and y must not overlap. ldx >= K, ldy >= N.
void matmul(ThreadPool& pool, const PackedWeight& W, const float* x, int64_t ldx, float* y, int64_t ldy,
            int64_t T, MatmulScratch& scratch);
void matmul(ThreadPool& pool, const Tensor& W, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t T,
            MatmulScratch& scratch);

// Contiguous x [T, K] and y [T, N].
inline void matmul(ThreadPool& pool, const PackedWeight& W, const float* x, float* y, int64_t T,
                   MatmulScratch& scratch) {
  matmul(pool, W, x, W.cols(), y, W.rows(), T, scratch);
}
inline void matmul(ThreadPool& pool, const Tensor& W, const float* x, float* y, int64_t T,
                   MatmulScratch& scratch) {
  matmul(pool, W, x, W.cols(), y, W.rows(), T, scratch);
}

// Several products of the same activations in one call (e.g. q, k and v, or gate
// and up): the activations are quantized once and one thread dispatch covers all
// weights of one dtype; weights of other dtypes (mixed GGUF files, adapters merged
// into some matrices only) run as their own groups. All must share K. Each result
// is bit-identical to its own matmul call. ldy < 0 means W.rows(). At most 16.
struct MatmulOut {
  const PackedWeight* W;
  float* y;
  int64_t ldy = -1;
};
void matmul_multi(ThreadPool& pool, std::span<const MatmulOut> outs, const float* x, int64_t ldx, int64_t T,
                  MatmulScratch& scratch);

// Whether matmul accepts weights of this dtype.
bool matmul_supports(DType type);

// Fast activation quantizers (bit-identical to quantize_row_q8_*_ref).
void quantize_row_q8_0(const float* x, void* dst, int64_t n);
void quantize_row_q8_1(const float* x, void* dst, int64_t n);
void quantize_row_q8_k(const float* x, void* dst, int64_t n);

}  // namespace loom
