// Backward of a linear layer y = x W^T (+ b), W {N, K}: the input gradient for
// weights of any dtype (frozen quantized/f16 weights included) and the weight and
// bias gradients of trainable f32 weights. Double-precision references:
// ref::linear_backward in kernels/ref/ops_backward_ref.h.
#pragma once

#include <cstdint>

#include <span>
#include <vector>

#include "core/cpu_features.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/scratch.h"

namespace loom {

// dx [T, K] += dy [T, N] W. W is any dtype that dequantize_row handles; it is
// dequantized tile by tile (64 rows x a block-aligned column slice) into a small
// per-thread f32 buffer, never as a whole f32 copy. Every dx element is one fixed
// chain of f32 FMAs over n = 0..N-1, so results do not depend on the thread count.
// (Tiles use dequantize_row, kernels/cpu/dequant.h: exact, and still a visible
// share of the time for small T.)
void linear_backward_input(ThreadPool& pool, const Tensor& W, const float* dy, float* dx, int64_t T);

// Fast input gradients through frozen weights: W^T packed once for the inference
// matmul kernels, so dx = dy W runs at matmul speed (the tile path above is
// several times slower). f32 and f16 weights keep their dtype (exact: the same
// products in another summation order); bf16 ones become f32 for ::f16 (exact;
// bf16 products would round dy to bf16) and stay bf16 for ::int8 (dy rounded to
// bf16, ~2e-3 relative). Quantized weights become
//  - f16 (TransposedPrecision::f16): each dequantized weight rounded to 11
//    significant bits; on SmolLM2 Q4_1 the LoRA gradients differ from the exact
//    path by 7e-4 relative (tests/model/test_training_default_model.cpp);
//  - q8_0 along N (::int8), with dy quantized to q8_0 by matmul like forward
//    activations: faster, but the gradients differ by ~3e-2 relative (cosine
//    0.9996).
//  - bf16 (::bf16): every weight (f32/f16 ones too) rounded to bf16 (8
//    significant bits, to nearest even, f32 subnormals to zero) in the tile
//    layout of kernels/cpu/bf16_gemm.h; linear_backward_input_packed rounds dy
//    the same way and multiplies with AMX-BF16 tiles, else AVX512-BF16
//    vdpbf16ps, else bf16 -> f32 and AVX2 FMA (Bf16Kernel), always with f32
//    sums. Each dx element is one chain over n in order: thread-count
//    independent. One product is ~2e-3 off the exact one, the LoRA gradients of
//    SmolLM2 Q4_1 ~1e-2 (cosine 0.99994). The fastest mode where AMX exists:
//    ~7x the f16 path's GFLOP/s at SmolLM2's shapes (bench_kernels
//    BackwardInput/...). matmul() rejects such a PackedWeight.
enum class TransposedPrecision { f16, int8, bf16 };
DType transposed_weight_dtype(DType w, int64_t n_total, TransposedPrecision p);
// Packs [W_0; W_1; ...]^T: the parts share K (their cols()) and are stacked by
// rows (N_total = sum of rows), so one product covers e.g. q, k and v:
// dx = [dq | dk | dv] [Wq; Wk; Wv]. Throws loom::Error naming `name` for parts
// that do not share K or have an unsupported dtype.
// `recycle` as for PackedWeight::pack.
// `scratch`: each thread's slice of W^T (kept across calls by a caller that
// repacks every step, full fine-tuning; null: allocated for the call); it grows
// to pack_transposed_floats().
PackedWeight pack_transposed(ThreadPool& pool, std::span<const Tensor> parts, TransposedPrecision precision,
                            const char* name = "weight", PackedWeight* recycle = nullptr,
                            ScratchFloats* scratch = nullptr);
size_t pack_transposed_floats(DType src, int64_t N, int64_t K, TransposedPrecision precision, int threads);
// Which kernel multiplies a bf16 W^T: automatic takes AMX, then AVX512-BF16,
// then AVX2 as the instructions present allow (usable_cpu_features(): the CPU,
// the OS and LOOM_CPU's masks); tests and benchmarks force one
// (loom::Error(unsupported) if the CPU lacks it). The three differ only in the
// f32 rounding of the sums.
enum class Bf16Kernel { automatic, amx, avx512, avx2 };
// Whether a forced kernel can run on this CPU (automatic: always); LOOM_CPU does
// not limit forced kernels.
bool bf16_kernel_available(Bf16Kernel k);
// The kernel automatic picks on a CPU with features `f` (never automatic).
Bf16Kernel automatic_bf16_kernel(const CpuFeatures& f);

// Working memory of linear_backward_input_packed; reuse it across calls.
struct PackedBackwardScratch {
  std::vector<float> dy, prod;
  MatmulScratch matmul;
};
// dx [T, K] (+)= dy [T, N] W with Wt = pack_transposed(W), dy rows ldy floats
// apart; accumulate = false overwrites dx. For a q8_0 Wt each dy row is first
// scaled by a power of two that brings its largest magnitude to ~2^16 (and the
// product scaled back, both exact): gradients are often ~1e-6, where q8_0's f16
// block scales would be subnormal and lose their precision. `kernel` matters only
// for a bf16 Wt.
void linear_backward_input_packed(ThreadPool& pool, const PackedWeight& Wt, const float* dy, int64_t ldy,
                                  float* dx, int64_t T, bool accumulate, PackedBackwardScratch& scratch,
                                  Bf16Kernel kernel = Bf16Kernel::automatic);

// The same bf16 products without any copy of W: W {N, K} is read in its own
// type (q4_0, q4_1, q5_0, q5_1, q8_0, f16, bf16, f32) and dequantized with
// AVX-512 into AMX B tiles right before use (kernels/cpu/bf16_gemm_direct.h).
// The operands are rounded exactly as pack_transposed(::bf16) and
// linear_backward_input_packed round them; only the f32 sums' grouping may differ
// (thread-count independent all the same). bf16_direct_available says whether
// this runs here: AMX usable (LOOM_CPU allowing) and a supported type.
bool bf16_direct_available(DType w);
void linear_backward_input_bf16_direct(ThreadPool& pool, const Tensor& W, const float* dy, int64_t ldy, float* dx,
                                       int64_t T, bool accumulate, PackedBackwardScratch& scratch);

// dW [N, K] += dy^T [N, T] x [T, K]   (f32; a trainable weight's gradient).
// Each element is one FMA chain over t = 0..T-1 (thread-count independent).
// `scratch` (kept by the caller across calls) holds each thread's transposed dy
// columns and, for a narrow dW (K < 16 <= N, a LoRA B), dW^T; it grows to
// linear_backward_weight_floats(). The overload without one allocates it per call.
void linear_backward_weight(ThreadPool& pool, const float* dy, const float* x, float* dW, int64_t T, int64_t N,
                            int64_t K, ScratchFloats& scratch);
void linear_backward_weight(ThreadPool& pool, const float* dy, const float* x, float* dW, int64_t T, int64_t N,
                            int64_t K);
size_t linear_backward_weight_floats(int64_t T, int64_t N, int64_t K, int threads);

// db [N] += sum_t dy [t, :]
void linear_backward_bias(const float* dy, float* db, int64_t T, int64_t N);

}  // namespace loom
