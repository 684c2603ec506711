// matmul on every weight type: exact agreement with the scalar model of the
// kernels' arithmetic, a sound error bound against a double-precision product,
// batch invariance, thread-count invariance, AVX2 == AVX-512, strides, errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "core/cpu_features.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/cpu/bf16_dot.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/panel.h"
#include "matmul_test_util.h"

namespace loom {
namespace {

using testing::matmul_tolerance;
using testing::model_dot;
using testing::random_floats;
using testing::random_weights;

const DType kAllTypes[] = {
    DType::q4_1,   DType::q8_0,    DType::f16,    DType::q4_k,  DType::q6_k,    DType::q4_0,  DType::q5_k,
    DType::bf16,   DType::f32,     DType::q5_0,   DType::q5_1,  DType::q2_k,    DType::q3_k,  DType::iq4_nl,
    DType::iq4_xs, DType::iq2_xxs, DType::iq2_xs, DType::iq2_s, DType::iq3_xxs, DType::iq3_s, DType::iq1_s,
    DType::iq1_m,  DType::tq1_0,   DType::tq2_0,  DType::q1_0,  DType::q2_0,    DType::mxfp4, DType::nvfp4};

std::vector<cpu::Isa> isas() {
  std::vector<cpu::Isa> v{cpu::Isa::avx2};
  if (cpu_features().has_avx512_kernels()) v.push_back(cpu::Isa::avx512);
  if (cpu_features().has_avx512_kernels() && cpu::amx_available()) v.push_back(cpu::Isa::amx);
  return v;
}

const char* isa_name(cpu::Isa isa) {
  return isa == cpu::Isa::avx2 ? "avx2" : isa == cpu::Isa::avx512 ? "avx512" : "amx";
}

struct Problem {
  DType type;
  int64_t N, K, T;
  std::vector<uint8_t> w;
  std::vector<float> x;
  Tensor W;
  Problem(DType t, int64_t n, int64_t k, int64_t tt, uint32_t seed)
      : type(t), N(n), K(k), T(tt), w(random_weights(t, n, k, seed)), x(random_floats(tt * k, seed + 77)) {
    W = make_tensor(w.data(), t, {n, k});
  }
  const uint8_t* row(int64_t n) const { return w.data() + static_cast<size_t>(n) * dtype_row_bytes(type, K); }
  std::vector<float> model() const {
    std::vector<float> y(static_cast<size_t>(N * T));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n)
        y[static_cast<size_t>(t * N + n)] = model_dot(type, row(n), x.data() + t * K, K);
    return y;
  }
};

int64_t test_k(DType type, int variant) {
  const int64_t bs = dtype_block_size(type);
  if (bs == 256) return variant == 0 ? 256 : 768;
  if (bs == 32) return variant == 0 ? 32 : 416;
  if (bs == 128 || bs == 64) return variant == 0 ? bs : 5 * bs;  // q1_0, q2_0, nvfp4
  return variant == 0 ? 5 : 203;  // float types: any K
}

void expect_bits_equal(const std::vector<float>& want, const std::vector<float>& got,
                       const std::string& what) {
  ASSERT_EQ(want.size(), got.size());
  int bad = 0;
  for (size_t i = 0; i < want.size() && bad < 5; ++i) {
    if (float_to_bits(want[i]) != float_to_bits(got[i])) {
      ADD_FAILURE() << what << " index " << i << ": want " << want[i] << " got " << got[i];
      ++bad;
    }
  }
}

// A panel kernel's arguments for problem `pr`: every panel of pw, act rows of arb
// bytes each for all of pr.T tokens, y of pr.N x pr.T; scratch and flags unset.
cpu::KernelArgs kernel_args(const PackedWeight& pw, const Problem& pr, const std::vector<uint8_t>& act, size_t arb,
                            std::vector<float>& y) {
  cpu::KernelArgs a;
  a.panels = pw.panel(0);
  a.panel_stride = pw.panel_bytes();
  a.n_panels = pw.n_panels();
  a.K = pr.K;
  a.act = act.data();
  a.act_stride = arb;
  a.T = pr.T;
  a.y = y.data();
  a.ldy = pr.N;
  a.n_valid = pr.N;
  return a;
}

// Every type, awkward N (not multiples of 16) and T in {1, 3, 17, 64}, both
// instruction sets, packed and plain weights, 1 and 2 threads: all bit-equal to
// the scalar model.
TEST(Matmul, AllTypesMatchScalarModelExactly) {
  ThreadPool pool1(1), pool2(2);
  MatmulScratch scratch;
  const int64_t Ns[] = {1, 17, 40};
  const int64_t Ts[] = {1, 3, 17, 64};
  uint32_t seed = 1;
  for (DType type : kAllTypes) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int64_t N : Ns) {
        for (int64_t T : Ts) {
          if (T == 64 && N != 17) continue;  // keep the run short
          Problem pr(type, N, test_k(type, kv), T, seed++);
          const auto want = pr.model();
          const PackedWeight pw = PackedWeight::pack(pr.W, &pool2);
          for (cpu::Isa isa : isas()) {
            for (ThreadPool* pool : {&pool1, &pool2}) {
              // Two threads once per problem is enough here (see ThreadCountAndIsaInvariant);
              // it keeps the test fast on a busy machine.
              if (pool == &pool2 && isa != isas().back()) continue;
              std::vector<float> y(static_cast<size_t>(N * T), -7.0f), y2(y);
              cpu::matmul_isa(isa, *pool, pw, pr.x.data(), pr.K, y.data(), N, T, scratch);
              cpu::matmul_isa(isa, *pool, pr.W, pr.x.data(), pr.K, y2.data(), N, T, scratch);
              const std::string what = std::string(dtype_name(type)) + " N=" + std::to_string(N) +
                                       " K=" + std::to_string(pr.K) + " T=" + std::to_string(T) + " " +
                                       isa_name(isa) + " threads=" + std::to_string(pool->size());
              expect_bits_equal(want, y, what + " packed");
              expect_bits_equal(want, y2, what + " tensor");
            }
          }
        }
      }
    }
  }
}

// The kernels' result is within the stated bound of the exact product of the
// dequantized weights with the (unquantized) activations.
TEST(Matmul, WithinActivationRoundingBoundOfDoubleReference) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  for (DType type : kAllTypes) {
    Problem pr(type, 33, test_k(type, 1), 5, 4242);
    std::vector<float> y(static_cast<size_t>(pr.N * pr.T));
    matmul(pool, pr.W, pr.x.data(), y.data(), pr.T, scratch);
    std::vector<float> wf(static_cast<size_t>(pr.K));
    for (int64_t t = 0; t < pr.T; ++t) {
      const float* xt = pr.x.data() + t * pr.K;
      for (int64_t n = 0; n < pr.N; ++n) {
        dequantize_row_ref(type, pr.row(n), wf.data(), pr.K);
        double exact = 0.0;
        for (int64_t k = 0; k < pr.K; ++k) exact += static_cast<double>(wf[static_cast<size_t>(k)]) * xt[k];
        const double tol = matmul_tolerance(type, pr.row(n), xt, pr.K);
        EXPECT_LE(std::fabs(y[static_cast<size_t>(t * pr.N + n)] - exact), tol)
            << dtype_name(type) << " t=" << t << " n=" << n << " exact=" << exact;
      }
    }
  }
}

// A row's result does not depend on the batch it is computed in.
TEST(Matmul, BatchInvariant) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  for (DType type : {DType::q4_1, DType::q8_0, DType::f16, DType::q4_k, DType::q6_k, DType::bf16}) {
    Problem pr(type, 70, test_k(type, 1), 29, 5);
    const PackedWeight pw = PackedWeight::pack(pr.W);
    for (cpu::Isa isa : isas()) {
      std::vector<float> batch(static_cast<size_t>(pr.N * pr.T));
      cpu::matmul_isa(isa, pool, pw, pr.x.data(), pr.K, batch.data(), pr.N, pr.T, scratch);
      for (int64_t t = 0; t < pr.T; ++t) {
        std::vector<float> one(static_cast<size_t>(pr.N));
        cpu::matmul_isa(isa, pool, pw, pr.x.data() + t * pr.K, pr.K, one.data(), pr.N, 1, scratch);
        for (int64_t n = 0; n < pr.N; ++n)
          ASSERT_EQ(float_to_bits(one[static_cast<size_t>(n)]),
                    float_to_bits(batch[static_cast<size_t>(t * pr.N + n)]))
              << dtype_name(type) << " " << isa_name(isa) << " t=" << t << " n=" << n;
      }
    }
  }
}

// Weight rows whose every quant byte is `fill` (the largest values where fill is
// 0xff) with the type's most negative scales, and normal f16 block scales: the
// largest sub-block dots and scale products the integer kernels meet (the
// AVX-512 tiles split each dot into bytes for vpdpwssd, exact only while |dot| < 2^23).
std::vector<uint8_t> extreme_weights(DType type, int64_t N, int64_t K, uint8_t fill) {
  std::vector<uint8_t> w(dtype_row_bytes(type, K) * static_cast<size_t>(N), fill);
  const size_t bb = dtype_traits(type).block_bytes;
  for (size_t off = 0; off < w.size(); off += bb) {
    uint8_t* blk = w.data() + off;
    switch (type) {
      case DType::q6_k:
        std::memset(blk + 192, 0x80, 16);  // i8 scales -128
        testing::put_f16(blk + 208, 0.01f);
        break;
      case DType::q3_k:
        testing::put_f16(blk + 108, 0.01f);
        break;
      case DType::q2_k:
        testing::put_f16(blk + 80, 0.01f);
        testing::put_f16(blk + 82, 0.01f);
        break;
      default:  // q4_k, q5_k (d, dmin), iq4_xs (d, then scales_h = 0xffff: scale 31)
        testing::put_f16(blk, 0.01f);
        if (type == DType::q4_k || type == DType::q5_k) testing::put_f16(blk + 2, 0.01f);
        break;
    }
  }
  return w;
}

// The extremes of the integer tiles' sums, for decode (T = 1) and batch tiles,
// with activations all at -1 (quantized to -127) or alternating: bit-equal to the
// scalar model.
TEST(Matmul, ExtremeWeightsAndActivationsMatchScalarModelExactly) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  for (DType type : {DType::q6_k, DType::q5_k, DType::q4_k, DType::q3_k, DType::q2_k, DType::iq4_xs})
    for (uint8_t fill : {uint8_t{0xff}, uint8_t{0x00}, uint8_t{0x5a}}) {
      const int64_t N = 35, K = 512;
      std::vector<uint8_t> w = extreme_weights(type, N, K, fill);
      const Tensor W = make_tensor(w.data(), type, {N, K});
      const PackedWeight pw = PackedWeight::pack(W);
      for (int signs = 0; signs < 2; ++signs)
        for (int64_t T : {int64_t{1}, int64_t{9}}) {
          std::vector<float> x(static_cast<size_t>(T * K));
          for (size_t i = 0; i < x.size(); ++i) x[i] = signs == 0 || i % 2 == 0 ? -1.0f : 1.0f;
          std::vector<float> want(static_cast<size_t>(N * T));
          const size_t rb = dtype_row_bytes(type, K);
          for (int64_t t = 0; t < T; ++t)
            for (int64_t n = 0; n < N; ++n)
              want[static_cast<size_t>(t * N + n)] = model_dot(type, w.data() + rb * n, x.data() + t * K, K);
          for (cpu::Isa isa : isas()) {
            std::vector<float> y(static_cast<size_t>(N * T), -7.0f);
            cpu::matmul_isa(isa, pool, pw, x.data(), K, y.data(), N, T, scratch);
            expect_bits_equal(want, y,
                              std::string(dtype_name(type)) + " fill=" + std::to_string(fill) + " signs=" +
                                  std::to_string(signs) + " T=" + std::to_string(T) + " " + isa_name(isa));
          }
        }
    }
}

// Batch tiles that walk tokens outside groups of panels (kTileGroupBytes,
// kernels/cpu/panel.h): matrices of several groups, a last group and
// a last token tile that are partial, 1 and 2 threads, bit-equal to the scalar model.
TEST(Matmul, SeveralPanelGroupsMatchScalarModelExactly) {
  constexpr int64_t kGroupBytes = cpu::kTileGroupBytes;
  ThreadPool pool1(1), pool2(2);
  MatmulScratch scratch;
  uint32_t seed = 900;
  for (DType type : {DType::q4_0, DType::q8_0, DType::q4_k, DType::q5_k, DType::q6_k, DType::q2_k,
                     DType::iq4_nl, DType::iq4_xs, DType::iq2_s, DType::iq3_xxs}) {
    const int64_t K = test_k(type, 1);
    const int64_t group_rows = kGroupBytes / static_cast<int64_t>(dtype_row_bytes(type, K)) / 16 * 16;
    Problem pr(type, 2 * group_rows + 37, K, 19, seed++);
    const auto want = pr.model();
    const PackedWeight pw = PackedWeight::pack(pr.W, &pool2);
    for (cpu::Isa isa : isas())
      for (ThreadPool* pool : {&pool1, &pool2}) {
        std::vector<float> y(static_cast<size_t>(pr.N * pr.T), -7.0f);
        cpu::matmul_isa(isa, *pool, pw, pr.x.data(), pr.K, y.data(), pr.N, pr.T, scratch);
        expect_bits_equal(want, y,
                          std::string(dtype_name(type)) + " N=" + std::to_string(pr.N) + " " + isa_name(isa) +
                              " threads=" + std::to_string(pool->size()));
      }
  }
}

// The batch kernels of most quantized types and f16 unpack each group of panels
// into scratch once and run the token tiles on the copy (AVX-512: q5_0, q5_1,
// iq4_nl, q2_k .. q6_k, iq4_xs, the iq2 / iq3 grid types and f16 widened to f32;
// AVX2: q4_0 .. q5_1, iq4_nl, q2_k, q3_k, q5_k, q6_k, iq4_xs, the grid types). With scratch for the
// default group, for three panels (the float tiles' three: several groups, the last one partial) and for none
// (the packed kernel), both instruction sets give the scalar model's bits. T = 19: the AVX-512 kernels' two
// full 8-token tiles and a partial one (AVX2: 4 full, 1 partial). With AVX512-VBMI the grid types run
// both AVX-512 kernels (KernelArgs::vbmi), as the native and the avx512-nobf16 ctest entries do.
TEST(Matmul, UnpackedPanelsEqualPackedKernel) {
  uint32_t seed = 950;
  for (DType type : {DType::q4_0,    DType::q4_1,   DType::q5_0,    DType::q5_1,   DType::q4_k,
                     DType::q5_k,    DType::q6_k,   DType::q3_k,    DType::q2_k,   DType::f16,
                     DType::iq4_nl,  DType::iq4_xs, DType::iq2_xxs, DType::iq2_xs, DType::iq2_s,
                     DType::iq3_xxs, DType::iq3_s,  DType::iq1_s,   DType::iq1_m,  DType::tq1_0,
                     DType::tq2_0,   DType::q1_0,   DType::q2_0,    DType::mxfp4,  DType::nvfp4}) {
    const int64_t K = test_k(type, 1);
    const DType kt = cpu::matmul_panel_type(type);  // the kernels' (TQ1_0 and TQ2_0: ternary panels)
    Problem pr(type, 16 * 6 + 3, K, 19, seed++);  // 7 panels: groups of 3, 3 and 1
    const auto want = pr.model();
    const PackedWeight pw = PackedWeight::pack(pr.W);
    for (cpu::Isa isa : isas()) {
      if (isa == cpu::Isa::amx) continue;  // k-quants run the AVX-512 kernels there
      const bool avx2 = isa == cpu::Isa::avx2;
      const cpu::UnpackedPanels u =
          avx2 ? cpu::unpacked_panels_avx2(kt, K) : cpu::unpacked_panels_avx512(kt, K);
      const size_t panel = u.panel_bytes;
      const bool q4 = kt == DType::q4_0 || kt == DType::q4_1;  // (q1_0, q2_0: q4_0 panels)
      const bool has_unpacked = kt == DType::q1_0 ? false      // (its bits unpack as cheaply as copies load)
                                : avx2            ? !(type == DType::q4_k || type == DType::f16)
                                                  : !q4;
      ASSERT_EQ(panel > 0, has_unpacked) << dtype_name(type) << " " << isa_name(isa);
      if (!has_unpacked) continue;
      ASSERT_EQ(u.tile_panels, type == DType::f16 ? 3 : 1) << dtype_name(type) << " " << isa_name(isa);
      const size_t group = cpu::unpack_scratch_bytes(u);
      ASSERT_GT(group, 3 * panel);
      auto act_rows = [&](cpu::ActKind kind) {
        const size_t arb = cpu::act_row_bytes(kind, K);
        std::vector<uint8_t> act(arb * static_cast<size_t>(pr.T));
        for (int64_t t = 0; t < pr.T; ++t)
          if (kind == cpu::ActKind::f32)
            std::memcpy(&act[arb * t], pr.x.data() + t * K, arb);
          else
            cpu::quantize_act_row(kind, kt, pr.x.data() + t * K, K, &act[arb * t]);
        return act;
      };
      const cpu::ActKind plain_kind = cpu::act_kind(kt, cpu::bf16_native(isa));
      const std::vector<uint8_t> plain = act_rows(plain_kind);
      // AVX2 q6_k, q3_k and the grid types: the unpacked kernel reads q8k_u8 rows; with
      // plain q8k rows (q8k_u8 unset) the packed kernel runs whatever the scratch.
      const bool u8_case = avx2 && (type == DType::q6_k || type == DType::q3_k || is_iq_grid(type));
      const std::vector<uint8_t> u8 = u8_case ? act_rows(cpu::ActKind::q8k_u8) : std::vector<uint8_t>{};
      // The grid types' AVX-512 kernels with and without VBMI's byte permutes (where the CPU has it).
      const bool vbmi_too = !avx2 && cpu::has_vbmi_kernel(type) && usable_cpu_features().avx512vbmi;
      for (size_t tmp_bytes : {size_t{0}, group, 3 * panel})
        for (int variant = 0; variant < (vbmi_too ? 4 : 2); ++variant) {
          const bool use_u8 = variant % 2 == 1, vbmi = variant >= 2;
          if (use_u8 && !(u8_case && tmp_bytes > 0)) continue;
          EXPECT_EQ(u8_case && tmp_bytes > 0, avx2 && cpu::avx2_u8_acts(type, K, pr.T, tmp_bytes));
          const cpu::ActKind kind = use_u8 ? cpu::ActKind::q8k_u8 : plain_kind;
          const std::vector<uint8_t>& act = use_u8 ? u8 : plain;
          const size_t arb = cpu::act_row_bytes(kind, K);
          std::vector<uint8_t> tmp(tmp_bytes);
          std::vector<float> y(static_cast<size_t>(pr.N * pr.T), -7.0f);
          cpu::KernelArgs a = kernel_args(pw, pr, act, arb, y);
          a.tmp = tmp_bytes > 0 ? tmp.data() : nullptr;
          a.tmp_bytes = tmp_bytes;
          a.q8k_u8 = use_u8;
          a.vbmi = vbmi;
          (avx2 ? cpu::panel_kernel_avx2 : cpu::panel_kernel_avx512)(kt, a);
          expect_bits_equal(want, y,
                            std::string(dtype_name(type)) + " " + isa_name(isa) +
                                " scratch=" + std::to_string(tmp_bytes) + (use_u8 ? " q8k_u8" : "") +
                                (vbmi ? " vbmi" : ""));
        }
    }
  }
}

// The AVX2 kernels built with AVX-VNNI (vpdpbusd in the 32-element types' block
// dots) give the scalar model's bits, decode and batch, packed and unpacked,
// whatever the matmul driver picks on this CPU (the unit_cpu_avx2 and
// unit_cpu_avx2-vnni ctest entries run the driver's choice of each).
TEST(Matmul, AvxVnniKernelsMatchScalarModel) {
  if (!cpu_features().avxvnni) GTEST_SKIP() << "no AVX-VNNI on this CPU: the kernels built for it cannot run";
  uint32_t seed = 1400;
  for (DType type : {DType::q4_0, DType::q4_1, DType::q5_0, DType::q5_1, DType::q8_0, DType::iq4_nl,
                     DType::mxfp4, DType::nvfp4, DType::q4_k, DType::q6_k}) {
    for (int64_t T : {int64_t{1}, int64_t{19}}) {
      Problem pr(type, 16 * 3 + 5, test_k(type, 1), T, seed++);
      const auto want = pr.model();
      const PackedWeight pw = PackedWeight::pack(pr.W);
      const cpu::ActKind kind = cpu::act_kind(type, false);
      const size_t arb = cpu::act_row_bytes(kind, pr.K);
      std::vector<uint8_t> act(arb * static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t)
        cpu::quantize_act_row(kind, type, pr.x.data() + t * pr.K, pr.K, &act[arb * t]);
      const cpu::UnpackedPanels u = cpu::unpacked_panels_avx2(type, pr.K);
      std::vector<uint8_t> tmp(u.panel_bytes > 0 ? cpu::unpack_scratch_bytes(u) : 0);
      for (bool unpacked : {false, true}) {
        if (unpacked && (tmp.empty() || T == 1)) continue;
        std::vector<float> y(static_cast<size_t>(pr.N * T), -7.0f);
        cpu::KernelArgs a = kernel_args(pw, pr, act, arb, y);
        a.tmp = unpacked ? tmp.data() : nullptr;
        a.tmp_bytes = unpacked ? tmp.size() : 0;
        cpu::panel_kernel_avx2_vnni(type, a);
        expect_bits_equal(
            want, y,
            std::string(dtype_name(type)) + " T=" + std::to_string(T) + (unpacked ? " unpacked" : ""));
      }
    }
  }
}

// Decode tiles of the integer-dot kernels read one or two panels side by side
// (KernelArgs::decode_panels, chosen per CPU by decode_panels_quant): both give
// the scalar model's bits, on every kernel build this CPU can run, whatever the
// driver picks here. 7 and 4 panels: tiles of two and a last one of one.
TEST(Matmul, DecodePanelsGiveTheSameBits) {
  uint32_t seed = 1500;
  for (DType type : kAllTypes) {
    const DType kt = cpu::matmul_panel_type(type);
    if (type == DType::f32 || type == DType::f16 || type == DType::bf16)
      continue;  // float kernels: their own
    for (int64_t N : {int64_t{16 * 6 + 3}, int64_t{16 * 4}}) {
      Problem pr(type, N, test_k(type, 1), 1, seed++);
      const auto want = pr.model();
      const PackedWeight pw = PackedWeight::pack(pr.W);
      const cpu::ActKind kind = cpu::act_kind(kt, false);
      const size_t arb = cpu::act_row_bytes(kind, pr.K);
      std::vector<uint8_t> act(arb);
      cpu::quantize_act_row(kind, kt, pr.x.data(), pr.K, act.data());
      std::vector<std::pair<const char*, cpu::PanelKernel>> builds{{"avx2", cpu::panel_kernel_avx2}};
      if (cpu_features().avxvnni) builds.emplace_back("avx2-vnni", cpu::panel_kernel_avx2_vnni);
      if (cpu_features().has_avx512_kernels()) builds.emplace_back("avx512", cpu::panel_kernel_avx512);
      for (const auto& [name, kernel] : builds)
        for (int panels = 1; panels <= cpu::kMaxDecodePanelsQuant; ++panels) {
          std::vector<float> y(static_cast<size_t>(N), -7.0f);
          cpu::KernelArgs a = kernel_args(pw, pr, act, arb, y);
          a.decode_panels = panels;
          kernel(kt, a);
          expect_bits_equal(want, y,
                            std::string(dtype_name(type)) + " N=" + std::to_string(N) + " " + name +
                                " decode_panels=" + std::to_string(panels));
        }
    }
  }
}

// bf16 weights on AVX-512 multiply either with vdpbf16ps (bf16pairs act rows) or
// with its f32-FMA emulation (bf16f32 rows); bf16_dot() picks one per CPU by speed,
// so each must give the scalar model's bits whichever this machine picks. Without
// AVX512-BF16 only the emulation can run (vdpbf16ps would fault): it is checked alone.
TEST(Matmul, Bf16DotAndItsFmaEmulationMatchScalarModel) {
  if (!cpu_features().has_avx512_kernels())  // AVX2's emulation: AllTypesMatchScalarModelExactly (bf16)
    GTEST_SKIP() << "no AVX-512 kernels on this CPU: the AVX-512 bf16 kernels cannot run";
  uint32_t seed = 1200;
  for (int64_t K : {int64_t{203}, int64_t{416}}) {
    for (int64_t T : {int64_t{1}, int64_t{3}, int64_t{19}}) {
      Problem pr(DType::bf16, 16 * 3 + 5, K, T, seed++);
      const auto want = pr.model();
      const PackedWeight pw = PackedWeight::pack(pr.W);
      for (bool pairs : {false, true}) {
        if (pairs && !usable_cpu_features().avx512bf16) continue;
        const cpu::ActKind kind = cpu::act_kind(DType::bf16, pairs);
        EXPECT_EQ(kind, pairs ? cpu::ActKind::bf16pairs : cpu::ActKind::bf16f32);
        const size_t arb = cpu::act_row_bytes(kind, K);
        std::vector<uint8_t> act(arb * static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t)
          cpu::quantize_act_row(kind, DType::bf16, pr.x.data() + t * K, K, &act[arb * t]);
        std::vector<float> y(static_cast<size_t>(pr.N * T), -7.0f);
        cpu::KernelArgs a = kernel_args(pw, pr, act, arb, y);
        a.bf16_pairs = pairs;
        cpu::panel_kernel_avx512(DType::bf16, a);
        expect_bits_equal(want, y,
                          std::string(pairs ? "vdpbf16ps" : "fma emulation") + " K=" + std::to_string(K) +
                              " T=" + std::to_string(T));
      }
    }
  }
}

// The choice between them: LOOM_BF16_DOT forces either; otherwise vdpbf16ps where one
// takes no longer than two FMAs (Zen 4: about one; Sapphire/Emerald Rapids: about four).
TEST(Matmul, Bf16DotChoice) {
  const cpu::Bf16DotTiming zen4{1.0, 1.0}, emerald_rapids{4.0, 1.0}, even{2.0, 1.0};
  EXPECT_EQ(cpu::choose_bf16_dot("", zen4), cpu::Bf16Dot::vdpbf16ps);
  EXPECT_EQ(cpu::choose_bf16_dot("", emerald_rapids), cpu::Bf16Dot::fma);
  EXPECT_EQ(cpu::choose_bf16_dot("", even), cpu::Bf16Dot::vdpbf16ps);
  EXPECT_EQ(cpu::choose_bf16_dot("fma", zen4), cpu::Bf16Dot::fma);
  EXPECT_EQ(cpu::choose_bf16_dot("vdpbf16ps", emerald_rapids), cpu::Bf16Dot::vdpbf16ps);
  EXPECT_EQ(cpu::choose_bf16_dot("amx", zen4), std::nullopt);
  if (!usable_cpu_features().avx512bf16) {
    EXPECT_EQ(cpu::bf16_dot(), cpu::Bf16Dot::fma);
    return;
  }
  // The probe itself: both loops ran and took time; the pick agrees with its figures.
  const cpu::Bf16DotTiming t = cpu::time_bf16_dot_instructions();
  EXPECT_GT(t.vdpbf16ps_s, 0.0);
  EXPECT_GT(t.fma_s, 0.0);
  EXPECT_EQ(cpu::bf16_native(cpu::Isa::avx512), cpu::bf16_dot() == cpu::Bf16Dot::vdpbf16ps);
  EXPECT_FALSE(cpu::bf16_native(cpu::Isa::avx2));
}

// Results do not depend on the number of threads, nor on the instruction set.
TEST(Matmul, ThreadCountAndIsaInvariant) {
  ThreadPool p1(1), p2(2), p3(3);  // 3: uneven splits
  MatmulScratch scratch;
  for (DType type : {DType::q4_1, DType::q8_0, DType::f16, DType::q5_k, DType::q3_k, DType::bf16}) {
    for (int64_t T : {int64_t{1}, int64_t{9}}) {
      Problem pr(type, 100, test_k(type, 1), T, 11);
      const PackedWeight pw = PackedWeight::pack(pr.W);
      std::vector<float> first;
      for (cpu::Isa isa : isas()) {
        for (ThreadPool* pool : {&p1, &p2, &p3}) {
          std::vector<float> y(static_cast<size_t>(pr.N * T));
          cpu::matmul_isa(isa, *pool, pw, pr.x.data(), pr.K, y.data(), pr.N, T, scratch);
          if (first.empty())
            first = y;
          else
            expect_bits_equal(first, y,
                              std::string(dtype_name(type)) + " " + isa_name(isa) +
                                  " threads=" + std::to_string(pool->size()));
        }
      }
    }
  }
}

// A panel split hands out chunks of panels as threads ask (matmul.cpp): with
// enough panels for several chunks per thread, decode and unpacked batches (and
// a batch of a type without unpacked panels) still write every output once and
// give the one-thread bits.
TEST(Matmul, PanelChunksClaimedByThreadsCoverEveryPanelOnce) {
  ThreadPool p1(1), p2(2), p3(3);
  MatmulScratch scratch;
  for (DType type : {DType::q4_k, DType::q6_k, DType::q8_0, DType::bf16}) {
    for (int64_t T : {int64_t{1}, int64_t{33}}) {
      Problem pr(type, 2000, 256, T, 97);
      const PackedWeight pw = PackedWeight::pack(pr.W);
      for (cpu::Isa isa : isas()) {
        std::vector<float> first;
        for (ThreadPool* pool : {&p1, &p2, &p3}) {
          std::vector<float> y(static_cast<size_t>(pr.N * T), std::nanf(""));
          cpu::matmul_isa(isa, *pool, pw, pr.x.data(), pr.K, y.data(), pr.N, T, scratch);
          const std::string what = std::string(dtype_name(type)) + " T=" + std::to_string(T) + " " +
                                   isa_name(isa) + " threads=" + std::to_string(pool->size());
          if (first.empty()) {
            for (float v : y) ASSERT_FALSE(std::isnan(v)) << what << ": an output was not written";
            first = y;
          } else {
            expect_bits_equal(first, y, what);
          }
        }
      }
    }
  }
}

// Row strides: x rows and y rows inside larger buffers; nothing outside is touched.
TEST(Matmul, StridedInputAndOutput) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  for (DType type : {DType::q4_1, DType::f16, DType::q6_k}) {
    Problem pr(type, 21, test_k(type, 1), 6, 8);
    const int64_t ldx = pr.K + 13, ldy = pr.N + 5;
    std::vector<float> xs(static_cast<size_t>(pr.T * ldx), 1e30f);
    for (int64_t t = 0; t < pr.T; ++t)
      std::copy(pr.x.begin() + t * pr.K, pr.x.begin() + (t + 1) * pr.K, xs.begin() + t * ldx);
    std::vector<float> y(static_cast<size_t>(pr.T * ldy), -3.0f);
    matmul(pool, PackedWeight::pack(pr.W), xs.data(), ldx, y.data(), ldy, pr.T, scratch);
    const auto want = pr.model();
    for (int64_t t = 0; t < pr.T; ++t) {
      for (int64_t n = 0; n < ldy; ++n) {
        const float got = y[static_cast<size_t>(t * ldy + n)];
        if (n < pr.N)
          EXPECT_EQ(float_to_bits(want[static_cast<size_t>(t * pr.N + n)]), float_to_bits(got))
              << t << "," << n;
        else
          EXPECT_EQ(got, -3.0f) << "wrote outside row " << t;
      }
    }
  }
}

// pack_concat: one matmul over stacked weights equals the separate products
// (bit for bit), with parts whose row counts are not multiples of 16.
TEST(Matmul, PackConcatEqualsSeparateProducts) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  for (DType type : {DType::q4_1, DType::f16, DType::q6_k, DType::q3_k}) {
    const int64_t K = test_k(type, 1), T = 5;
    Problem a(type, 23, K, T, 31), b(type, 9, K, T, 32), c(type, 40, K, T, 33);
    const Tensor parts[] = {a.W, b.W, c.W};
    const PackedWeight pw = PackedWeight::pack_concat(parts, &pool, "qkv");
    ASSERT_EQ(pw.rows(), 72);
    std::vector<float> y(static_cast<size_t>(72 * T));
    matmul(pool, pw, a.x.data(), y.data(), T, scratch);
    int64_t off = 0;
    for (const Problem* pr : {&a, &b, &c}) {
      std::vector<float> ys(static_cast<size_t>(pr->N * T));
      matmul(pool, pr->W, a.x.data(), ys.data(), T, scratch);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t n = 0; n < pr->N; ++n)
          ASSERT_EQ(float_to_bits(ys[static_cast<size_t>(t * pr->N + n)]),
                    float_to_bits(y[static_cast<size_t>(t * 72 + off + n)]))
              << dtype_name(type) << " part row " << n << " t " << t;
      off += pr->N;
    }
  }
  std::vector<uint8_t> buf(4096);
  const Tensor parts[] = {make_tensor(buf.data(), DType::q4_1, {2, 64}),
                          make_tensor(buf.data(), DType::q8_0, {2, 64})};
  EXPECT_THROW(PackedWeight::pack_concat(parts), Error);
}

// matmul_multi: each output bit-identical to its own matmul call, with strided
// outputs; few panels with T > 1 also exercises the token split.
TEST(Matmul, MultiEqualsSeparateCalls) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  for (DType type : {DType::q4_1, DType::q8_0, DType::f16, DType::q4_k}) {
    for (int64_t T : {int64_t{1}, int64_t{3}, int64_t{20}}) {
      const int64_t K = test_k(type, 1);
      Problem a(type, 40, K, T, 51), b(type, 17, K, T, 52), c(type, 9, K, T, 53);
      const PackedWeight pa = PackedWeight::pack(a.W), pb = PackedWeight::pack(b.W),
                         pc = PackedWeight::pack(c.W);
      for (cpu::Isa isa : isas()) {
        std::vector<float> ya(static_cast<size_t>(T * 40)), yb(static_cast<size_t>(T * 20), -1.0f),
            yc(static_cast<size_t>(T * 9));
        const MatmulOut outs[] = {{&pa, ya.data()}, {&pb, yb.data(), 20}, {&pc, yc.data()}};
        cpu::matmul_multi_isa(isa, pool, outs, a.x.data(), K, T, scratch);
        for (const auto& [pw, y, ld] : {std::tuple{&pa, &ya, int64_t{40}}, std::tuple{&pb, &yb, int64_t{20}},
                                        std::tuple{&pc, &yc, int64_t{9}}}) {
          std::vector<float> want(static_cast<size_t>(T * ld), -1.0f);
          cpu::matmul_isa(isa, pool, *pw, a.x.data(), K, want.data(), ld, T, scratch);
          expect_bits_equal(want, *y,
                            std::string(dtype_name(type)) + " multi " + isa_name(isa) +
                                " T=" + std::to_string(T) + " N=" + std::to_string(pw->rows()));
        }
      }
    }
  }
  Problem a(DType::q4_1, 4, 64, 1, 1), b(DType::q8_0, 4, 128, 1, 2);
  const PackedWeight pa = PackedWeight::pack(a.W), pb = PackedWeight::pack(b.W);
  std::vector<float> y(8);
  const MatmulOut widths[] = {{&pa, y.data()}, {&pb, y.data() + 4}};
  EXPECT_THROW(matmul_multi(pool, widths, a.x.data(), 128, 1, scratch), Error);
}

// Mixed dtypes in one call (Q4_K_M-style q4_k/q6_k/q5_0/q8_0 layers, f32 adapter
// merges beside quantized weights): each output bit-identical to its own call,
// whatever the order of the types.
TEST(Matmul, MultiMixedTypesEqualsSeparateCalls) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  const DType mixes[][3] = {{DType::q4_k, DType::q4_k, DType::q6_k},
                            {DType::q5_0, DType::q8_0, DType::q5_0},
                            {DType::f32, DType::q4_1, DType::q4_1},
                            {DType::q4_1, DType::f32, DType::q8_0}};
  for (const auto& mix : mixes) {
    for (int64_t T : {int64_t{1}, int64_t{3}, int64_t{20}}) {
      const int64_t K = 256;
      Problem a(mix[0], 40, K, T, 61), b(mix[1], 17, K, T, 62), c(mix[2], 9, K, T, 63);
      const PackedWeight pa = PackedWeight::pack(a.W), pb = PackedWeight::pack(b.W),
                         pc = PackedWeight::pack(c.W);
      for (cpu::Isa isa : isas()) {
        std::vector<float> ya(static_cast<size_t>(T * 40)), yb(static_cast<size_t>(T * 17)),
            yc(static_cast<size_t>(T * 9));
        const MatmulOut outs[] = {{&pa, ya.data()}, {&pb, yb.data()}, {&pc, yc.data()}};
        cpu::matmul_multi_isa(isa, pool, outs, a.x.data(), K, T, scratch);
        for (const auto& [pw, y] : {std::pair{&pa, &ya}, std::pair{&pb, &yb}, std::pair{&pc, &yc}}) {
          std::vector<float> want(y->size());
          cpu::matmul_isa(isa, pool, *pw, a.x.data(), K, want.data(), pw->rows(), T, scratch);
          expect_bits_equal(want, *y,
                            std::string(dtype_name(pw->dtype())) + " in a mixed multi " + isa_name(isa) +
                                " T=" + std::to_string(T));
        }
      }
    }
  }
}

TEST(Matmul, RejectsBadWeights) {
  ThreadPool pool(1);
  MatmulScratch scratch;
  std::vector<uint8_t> buf(4096);
  std::vector<float> x(256), y(16);
  const Tensor i8 = make_tensor(buf.data(), DType::i8, {2, 64});
  EXPECT_THROW(matmul(pool, i8, x.data(), y.data(), 1, scratch), Error);
  EXPECT_THROW(PackedWeight::pack(i8), Error);
  const Tensor q4 = make_tensor(buf.data(), DType::q4_1, {2, 48});  // K not a multiple of 32
  EXPECT_THROW(matmul(pool, q4, x.data(), y.data(), 1, scratch), Error);
  const Tensor ok = make_tensor(buf.data(), DType::q4_1, {2, 64});
  EXPECT_THROW(matmul(pool, ok, x.data(), 10, y.data(), 2, 1, scratch), Error);  // ldx < K
  EXPECT_FALSE(matmul_supports(DType::q8_k));
  EXPECT_TRUE(matmul_supports(DType::q4_1));
  try {
    PackedWeight::pack(i8, nullptr, "blk.0.attn_q.weight");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("blk.0.attn_q.weight"), std::string::npos);
    EXPECT_EQ(e.kind(), ErrorKind::unsupported);
  }
}

TEST(Matmul, ZeroTokensIsANoOp) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  Problem pr(DType::q8_0, 4, 64, 1, 3);
  float y = 5.0f;
  matmul(pool, pr.W, pr.x.data(), &y, 0, scratch);
  EXPECT_EQ(y, 5.0f);
}

}  // namespace
}  // namespace loom
