// i8_ch (per-channel int8 weights, per-token int8 activations; kernels/ref/
// i8ch_ref.h): the dtype, the weight quantizer, dequantize_row and the
// activation quantizer against the scalar reference, the AVX2 / AVX-512 matmul
// kernels bit for bit against matmul_i8ch_ref (every width, T = 1..70 and large
// batches, 1 and 3 threads, packed and plain weights, codes at the int8 limits,
// the widest K the int32 sums allow), matmul_multi with other dtypes, the error
// against double-precision and f32 products, and the backward through frozen
// i8_ch weights (exact tiles, W^T packed as f16 / int8 / bf16).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/half.h"
#include "core/thread_pool.h"
#include "expect_error.h"
#include "kernels/cpu/dequant.h"
#include "kernels/cpu/i8ch.h"
#include "kernels/cpu/linear_backward.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/panel.h"
#include "kernels/quantize.h"
#include "kernels/ref/dequant_ref.h"
#include "kernels/ref/i8ch_ref.h"
#include "matmul_test_util.h"

namespace loom {
namespace {

using testing::random_floats;

std::vector<cpu::Isa> isas() {
  std::vector<cpu::Isa> v{cpu::Isa::avx2};
  if (cpu_features().has_avx512_kernels()) v.push_back(cpu::Isa::avx512);
  if (cpu_features().has_avx512_kernels() && cpu::amx_available()) v.push_back(cpu::Isa::amx);
  return v;
}
const char* isa_name(cpu::Isa isa) {
  return isa == cpu::Isa::avx2 ? "avx2" : isa == cpu::Isa::avx512 ? "avx512" : "amx(avx512 kernel)";
}

size_t row_bytes(int64_t K) { return dtype_row_bytes(DType::i8_ch, K); }

// How test weights get their scales and zero points.
enum class Scheme {
  minmax,     // asymmetric: the row's [min, max] onto [-128, 127], zero != 0
  symmetric,  // amax / 127, zero = 0
  random,     // random codes over all of [-128, 127], random integer zeros
};

struct Weights {
  int64_t N = 0, K = 0;
  std::vector<float> f32;      // the source weights (not for Scheme::random)
  std::vector<uint8_t> bytes;  // N i8_ch rows
  Tensor tensor() { return make_tensor(bytes.data(), DType::i8_ch, {N, K}); }
  const uint8_t* row(int64_t n) const { return bytes.data() + static_cast<size_t>(n) * row_bytes(K); }
};

Weights make_weights(int64_t N, int64_t K, uint32_t seed, Scheme scheme) {
  Weights w;
  w.N = N;
  w.K = K;
  w.bytes.resize(static_cast<size_t>(N) * row_bytes(K));
  std::mt19937 rng(seed);
  if (scheme == Scheme::random) {
    std::uniform_int_distribution<int> code(-128, 127);
    std::uniform_real_distribution<float> sc(1e-3f, 2e-2f);
    for (int64_t n = 0; n < N; ++n) {
      uint8_t* r = w.bytes.data() + static_cast<size_t>(n) * row_bytes(K);
      const I8ChHeader h{sc(rng), static_cast<float>(code(rng))};
      std::memcpy(r, &h, sizeof h);
      for (int64_t k = 0; k < K; ++k) r[kI8ChHeaderBytes + static_cast<size_t>(k)] = static_cast<uint8_t>(code(rng));
    }
    return w;
  }
  w.f32 = random_floats(N * K, seed, 0.05f);
  std::vector<float> scales(static_cast<size_t>(N)), zeros(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    float* x = w.f32.data() + n * K;
    for (int64_t k = 0; k < K; ++k) x[k] *= static_cast<float>(1 + n % 5);  // rows of different magnitude
    x[(n * 7) % K] += n % 2 == 0 ? 0.3f : -0.2f;                           // an outlier per row
    float lo = 0.0f, hi = 0.0f, amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      lo = std::min(lo, x[k]);
      hi = std::max(hi, x[k]);
      amax = std::max(amax, std::fabs(x[k]));
    }
    const auto i = static_cast<size_t>(n);
    if (scheme == Scheme::symmetric) {
      scales[i] = amax / 127.0f;
      zeros[i] = 0.0f;
    } else {
      scales[i] = (hi - lo) / 255.0f;
      zeros[i] = scales[i] > 0 ? std::clamp(std::round(-128.0f - lo / scales[i]), -128.0f, 127.0f) : 0.0f;
    }
  }
  quantize_rows_i8_ch(w.f32.data(), N, K, scales.data(), zeros.data(), w.bytes.data());
  return w;
}

void expect_bits_equal(const std::vector<float>& want, const std::vector<float>& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < want.size() && bad < 5; ++i)
    if (float_to_bits(want[i]) != float_to_bits(got[i])) {
      ADD_FAILURE() << what << " index " << i << ": want " << want[i] << " got " << got[i];
      ++bad;
    }
}

std::vector<float> reference(const Weights& w, const std::vector<float>& x, int64_t T) {
  std::vector<float> y(static_cast<size_t>(w.N * T));
  matmul_i8ch_ref(w.bytes.data(), w.N, w.K, x.data(), T, y.data());
  return y;
}

// ---- the dtype and the quantizer ----

TEST(I8Ch, DTypeIsLoomsOwnWithARowHeader) {
  EXPECT_FALSE(dtype_traits_of_id(1001).has_value());  // never from a GGUF file
  EXPECT_FALSE(dtype_traits_of_id(1000).has_value());
  EXPECT_EQ(static_cast<uint32_t>(DType::i8_ch), 1001u);
  EXPECT_EQ(dtype_from_name("I8_CH"), DType::i8_ch);
  EXPECT_STREQ(dtype_name(DType::i8_ch), "i8_ch");
  EXPECT_EQ(dtype_block_size(DType::i8_ch), 1);
  EXPECT_TRUE(dtype_is_quantized(DType::i8_ch));
  EXPECT_EQ(dtype_row_header_bytes(DType::i8_ch), 8u);
  EXPECT_EQ(dtype_row_bytes(DType::i8_ch, 576), 584u);
  EXPECT_EQ(dtype_row_bytes(DType::i8_ch, 1), 9u);
  const Tensor t = make_tensor(nullptr, DType::i8_ch, {3, 40});
  EXPECT_EQ(t.row_bytes(), 48u);
  EXPECT_EQ(t.nbytes(), 144u);
  EXPECT_TRUE(matmul_supports(DType::i8_ch));
  // Every other type: no header, row bytes unchanged.
  for (uint32_t id = 0; id < 64; ++id)
    if (const auto tr = dtype_traits_of_id(id)) {
      EXPECT_EQ(tr->row_header_bytes, 0u) << tr->name;
      EXPECT_EQ(dtype_row_bytes(tr->type, 4 * tr->block_size), 4 * tr->block_bytes) << tr->name;
    }
  EXPECT_EQ(dtype_row_header_bytes(DType::nf4), 0u);
}

TEST(I8Ch, QuantizeRowsRoundsHalfAwayAndClamps) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // scale 0.5, zero 3: w / 0.5 + 3
  const std::vector<float> w = {1.25f, -1.25f, -3.25f, 100.0f, -100.0f, nan, 0.0f, 0.24f, 62.0f, -65.5f};
  const std::vector<int> want = {6, 1, -4, 127, -128, 3, 3, 3, 127, -128};
  const float scale = 0.5f, zero = 3.0f;
  std::vector<uint8_t> out(row_bytes(static_cast<int64_t>(w.size())));
  quantize_rows_i8_ch(w.data(), 1, static_cast<int64_t>(w.size()), &scale, &zero, out.data());
  const I8ChHeader h = i8ch_header(out.data());
  EXPECT_EQ(h.scale, 0.5f);
  EXPECT_EQ(h.zero, 3.0f);
  for (size_t k = 0; k < w.size(); ++k)
    EXPECT_EQ(static_cast<int8_t>(out[kI8ChHeaderBytes + k]), want[k]) << "w = " << w[k];

  // Symmetric (zeros null), and a zero scale (every code = zero point, value 0).
  const float sc2[2] = {0.25f, 0.0f}, z2[2] = {0.0f, -7.0f};
  const float w2[4] = {0.375f, -0.375f, 5.0f, -5.0f};
  std::vector<uint8_t> o2(2 * row_bytes(2));
  quantize_rows_i8_ch(w2, 2, 2, sc2, nullptr, o2.data());
  EXPECT_EQ(static_cast<int8_t>(o2[8]), 2);  // 1.5 -> 2
  EXPECT_EQ(static_cast<int8_t>(o2[9]), -2);
  EXPECT_EQ(i8ch_header(o2.data() + row_bytes(2)).zero, 0.0f);
  quantize_rows_i8_ch(w2, 2, 2, sc2, z2, o2.data());
  EXPECT_EQ(static_cast<int8_t>(o2[row_bytes(2) + 8]), -7);
  EXPECT_EQ(static_cast<int8_t>(o2[row_bytes(2) + 9]), -7);
  float deq[2];
  dequantize_row(DType::i8_ch, o2.data() + row_bytes(2), deq, 2);
  EXPECT_EQ(deq[0], 0.0f);

  // Bad zero points and scales are refused, naming the row.
  for (float z : {0.5f, 128.0f, -129.0f, nan}) {
    const float zs[2] = {0.0f, z};
    test_util::expect_error([&] { quantize_rows_i8_ch(w2, 2, 2, sc2, zs, o2.data()); }, ErrorKind::invalid_input,
                            {"row 1", "zero point"});
  }
  const float bad_scale[1] = {std::numeric_limits<float>::infinity()};
  test_util::expect_error([&] { quantize_rows_i8_ch(w2, 1, 2, bad_scale, nullptr, o2.data()); },
                          ErrorKind::invalid_input, {"row 0", "scale"});
}

// Quantize then dequantize: within half a step of the source (minus clamping).
TEST(I8Ch, QuantizeRowsRoundTripWithinHalfAStep) {
  for (Scheme s : {Scheme::minmax, Scheme::symmetric}) {
    const Weights w = make_weights(37, 300, 5, s);
    std::vector<float> deq(300);
    for (int64_t n = 0; n < w.N; ++n) {
      dequantize_row(DType::i8_ch, w.row(n), deq.data(), w.K);
      const float step = i8ch_header(w.row(n)).scale;
      for (int64_t k = 0; k < w.K; ++k)
        ASSERT_LE(std::fabs(deq[static_cast<size_t>(k)] - w.f32[static_cast<size_t>(n * w.K + k)]), 0.5001f * step)
            << "row " << n << " col " << k;
    }
  }
}

// ---- dequantize_row and the activation rows against the reference ----

TEST(I8Ch, DequantizeRowEqualsReferenceAtModelWidths) {
  for (int64_t K : {1, 3, 5, 40, 576, 1536, 2048, 8192, 14336}) {
    for (Scheme s : {Scheme::random, Scheme::minmax}) {
      Weights w = make_weights(3, K, static_cast<uint32_t>(K), s);
      // An unaligned copy: rows of 8 + K bytes sit anywhere.
      std::vector<uint8_t> odd(w.bytes.size() + 1);
      std::memcpy(odd.data() + 1, w.bytes.data(), w.bytes.size());
      std::vector<float> want(static_cast<size_t>(K)), got(want.size(), -1.0f);
      for (int64_t n = 0; n < w.N; ++n) {
        const uint8_t* row = odd.data() + 1 + static_cast<size_t>(n) * row_bytes(K);
        dequantize_row_ref(DType::i8_ch, row, want.data(), K);
        dequantize_row(DType::i8_ch, row, got.data(), K);
        expect_bits_equal(want, got, "K=" + std::to_string(K) + " row " + std::to_string(n));
        // The definition, once more by hand.
        const I8ChHeader h = i8ch_header(row);
        for (int64_t k = 0; k < K; k += 97) {
          const float q = static_cast<float>(static_cast<int8_t>(row[8 + k]));
          EXPECT_EQ(float_to_bits(got[static_cast<size_t>(k)]), float_to_bits(h.scale * (q - h.zero)));
        }
        // Column slices (the backward's tiles) equal the whole row's columns.
        for (int64_t c0 : {int64_t{0}, int64_t{1}, K / 2, K - 1}) {
          if (c0 < 0 || c0 >= K) continue;
          const int64_t n_cols = std::min<int64_t>(K - c0, 131);
          std::vector<float> part(static_cast<size_t>(n_cols));
          dequantize_row_cols(DType::i8_ch, row, c0, part.data(), n_cols);
          expect_bits_equal(std::vector<float>(want.begin() + c0, want.begin() + c0 + n_cols), part,
                            "slice at " + std::to_string(c0));
        }
      }
    }
  }
  // Header-less types: dequantize_row_cols is dequantize_row at the column's block.
  auto q = testing::random_weights(DType::q4_k, 2, 768, 3);
  std::vector<float> whole(768), part(256);
  dequantize_row(DType::q4_k, q.data() + dtype_row_bytes(DType::q4_k, 768), whole.data(), 768);
  dequantize_row_cols(DType::q4_k, q.data() + dtype_row_bytes(DType::q4_k, 768), 256, part.data(), 256);
  expect_bits_equal(std::vector<float>(whole.begin() + 256, whole.begin() + 512), part, "q4_k slice");
}

TEST(I8Ch, ActivationRowEqualsReference) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::mt19937 rng(9);
  for (int64_t K : {1, 7, 8, 15, 16, 17, 31, 32, 33, 40, 100, 576, 2048, 14336}) {
    for (int variant = 0; variant < 5; ++variant) {
      std::vector<float> x = random_floats(K, static_cast<uint32_t>(K * 10 + variant));
      if (variant == 1) std::fill(x.begin(), x.end(), 0.0f);
      if (variant == 2) x[static_cast<size_t>(K / 2)] = nan;
      if (variant == 3) {  // exact ties: k/2 steps of amax/127 with amax = 127
        for (int64_t k = 0; k < K; ++k) x[static_cast<size_t>(k)] = static_cast<float>(k % 255 - 127) * 0.5f;
        x[0] = 127.0f;
      }
      if (variant == 4) x[static_cast<size_t>(rng() % K)] = -inf;
      std::vector<int8_t> want(static_cast<size_t>(K));
      int32_t want_sum = 0;
      const float s = quantize_act_row_i8ch_ref(x.data(), K, want.data(), &want_sum);
      // The dispatching quantizer (LOOM_CPU steers it), and each version this CPU runs.
      std::vector<void (*)(const float*, int64_t, uint8_t*)> fns = {cpu::quantize_act_row_i8ch,
                                                                   cpu::quantize_act_row_i8ch_avx2};
      if (cpu_features().has_avx512_f32()) fns.push_back(cpu::quantize_act_row_i8ch_avx512);
      for (size_t f = 0; f < fns.size(); ++f) {
        std::vector<uint8_t> row(cpu::i8ch_act_row_bytes(K), 0xEE);
        fns[f](x.data(), K, row.data());
        float got_s;
        int32_t got_sum;
        std::memcpy(&got_s, row.data(), 4);
        std::memcpy(&got_sum, row.data() + 4, 4);
        const std::string what =
            "K=" + std::to_string(K) + " variant " + std::to_string(variant) + " quantizer " + std::to_string(f);
        EXPECT_EQ(float_to_bits(got_s), float_to_bits(s)) << what;
        EXPECT_EQ(got_sum, want_sum) << what;
        for (int64_t k = 0; k < K; ++k) {
          const int8_t q = want[static_cast<size_t>(k)];
          ASSERT_GE(q, -127) << what;  // never -128 (the AVX2 sign trick needs it)
          ASSERT_EQ(row[cpu::kI8ChActHeader + static_cast<size_t>(k)], static_cast<uint8_t>(q + 128))
              << what << " k=" << k;
        }
        for (size_t k = cpu::kI8ChActHeader + static_cast<size_t>(K); k < row.size(); ++k)
          ASSERT_EQ(row[k], 0x80) << what << " padding";  // qx = 0
      }
    }
  }
}

// ---- matmul ----

// T = 1..70 (every tile remainder of both ISAs), partial panels (N = 40, 90),
// a width that is not a multiple of 4, one that takes two K chunks (1100),
// packed and plain weights, 1 and 3 threads.
TEST(MatmulI8Ch, MatchesReferenceBitForBitT1To70) {
  ThreadPool pool1(1), pool3(3);
  MatmulScratch scratch;
  struct Shape {
    int64_t N, K;
  };
  for (const Shape sh : {Shape{40, 72}, Shape{90, 45}, Shape{64, 1100}}) {
    const int64_t K = sh.K;
    Weights w = make_weights(sh.N, K, 11, Scheme::random);
    const Tensor W = w.tensor();
    const PackedWeight pw = PackedWeight::pack(W, &pool3);
    for (int64_t T = 1; T <= 70; ++T) {
      const auto x = random_floats(T * K, static_cast<uint32_t>(100 + T));
      const auto want = reference(w, x, T);
      for (cpu::Isa isa : isas())
        for (ThreadPool* pool : {&pool1, &pool3}) {
          std::vector<float> y(want.size(), -7.0f), y2(want.size(), -7.0f);
          cpu::matmul_isa(isa, *pool, pw, x.data(), K, y.data(), w.N, T, scratch);
          cpu::matmul_isa(isa, *pool, W, x.data(), K, y2.data(), w.N, T, scratch);
          const std::string what = "N=" + std::to_string(sh.N) + " K=" + std::to_string(K) + " T=" + std::to_string(T) + " " + isa_name(isa) +
                                   " threads=" + std::to_string(pool->size());
          expect_bits_equal(want, y, what + " packed");
          expect_bits_equal(want, y2, what + " tensor");
        }
    }
  }
}

// Large batches at model widths, with strides, through the default dispatch too
// (which LOOM_CPU steers: ctest's unit_cpu_* runs).
TEST(MatmulI8Ch, MatchesReferenceAtLargeBatches) {
  ThreadPool pool1(1), pool3(3);
  MatmulScratch scratch;
  struct Shape {
    int64_t N, K, T;
  };
  for (const Shape s : {Shape{50, 576, 128}, Shape{33, 1536, 257}, Shape{70, 576, 512}, Shape{90, 2048, 200}}) {
    Weights w = make_weights(s.N, s.K, static_cast<uint32_t>(s.N + s.K), Scheme::minmax);
    const PackedWeight pw = PackedWeight::pack(w.tensor(), &pool3);
    const int64_t ldx = s.K + 3, ldy = s.N + 5;
    const auto x = random_floats(s.T * ldx, static_cast<uint32_t>(s.T));
    std::vector<float> xc(static_cast<size_t>(s.T * s.K));
    for (int64_t t = 0; t < s.T; ++t) std::copy_n(x.data() + t * ldx, s.K, xc.data() + t * s.K);
    const auto want = reference(w, xc, s.T);
    auto check = [&](const std::vector<float>& y, const std::string& what) {
      std::vector<float> got(want.size());
      for (int64_t t = 0; t < s.T; ++t) std::copy_n(y.data() + t * ldy, s.N, got.data() + t * s.N);
      expect_bits_equal(want, got, what);
    };
    const std::string shape = std::to_string(s.N) + "x" + std::to_string(s.K) + " T=" + std::to_string(s.T);
    for (ThreadPool* pool : {&pool1, &pool3}) {
      const std::string th = " threads=" + std::to_string(pool->size());
      for (cpu::Isa isa : isas()) {
        std::vector<float> y(static_cast<size_t>(s.T * ldy), -7.0f);
        cpu::matmul_isa(isa, *pool, pw, x.data(), ldx, y.data(), ldy, s.T, scratch);
        check(y, shape + " " + isa_name(isa) + th);
      }
      std::vector<float> y(static_cast<size_t>(s.T * ldy), -7.0f);
      matmul(*pool, pw, x.data(), ldx, y.data(), ldy, s.T, scratch);
      check(y, shape + " default (" + cpu_class_name(cpu_class()) + ")" + th);
    }
  }
}

// Every width from 1 (packed words padded with codes that add nothing).
TEST(MatmulI8Ch, AnyWidth) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  for (int64_t K : {1, 2, 3, 4, 5, 6, 7, 9, 13, 40, 100, 131, 576}) {
    Weights w = make_weights(19, K, static_cast<uint32_t>(K), Scheme::random);
    const PackedWeight pw = PackedWeight::pack(w.tensor());
    EXPECT_EQ(pw.panel_bytes() % 64, 0u);
    for (int64_t T : {1, 2, 7, 13}) {
      const auto x = random_floats(T * K, static_cast<uint32_t>(K + T));
      const auto want = reference(w, x, T);
      for (cpu::Isa isa : isas()) {
        std::vector<float> y(want.size());
        cpu::matmul_isa(isa, pool, pw, x.data(), K, y.data(), w.N, T, scratch);
        expect_bits_equal(want, y, "K=" + std::to_string(K) + " T=" + std::to_string(T) + " " + isa_name(isa));
      }
    }
  }
}

// Codes at the int8 limits: no int16 saturation in the AVX2 sign trick
// (|q| = 128 times qx = +-127: pairs of 32512), no lost bits in the VNNI offset,
// and the widest K whose exact sum still fits int32 (|acc| = 65536 * 127 * 255).
TEST(MatmulI8Ch, CodesAtTheLimitsAndTheWidestRow) {
  ThreadPool pool(3);
  MatmulScratch scratch;
  for (int64_t K : {int64_t{4096}, kI8ChMaxCols}) {
    const int64_t N = 24, T = 6;
    Weights w;
    w.N = N;
    w.K = K;
    w.bytes.resize(static_cast<size_t>(N) * row_bytes(K));
    std::vector<double> qsum(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) {
      uint8_t* r = w.bytes.data() + static_cast<size_t>(n) * row_bytes(K);
      const float zeros[] = {127.0f, -128.0f, 0.0f};
      const I8ChHeader h{n % 2 == 0 ? 0.0078125f : 3.0f, zeros[n % 3]};
      std::memcpy(r, &h, sizeof h);
      for (int64_t k = 0; k < K; ++k) {
        int q;
        switch (n % 4) {
          case 0: q = -128; break;
          case 1: q = 127; break;
          case 2: q = k % 2 == 0 ? -128 : 127; break;
          default: q = (k * 37) % 256 - 128; break;
        }
        r[kI8ChHeaderBytes + static_cast<size_t>(k)] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
    }
    // Activations whose codes are +-127 (every |x| = amax), alternating, and 0.
    std::vector<float> x(static_cast<size_t>(T * K));
    for (int64_t k = 0; k < K; ++k) {
      const auto i = static_cast<size_t>(k);
      x[i] = 2.0f;                                      // qx = 127
      x[static_cast<size_t>(K) + i] = -0.5f;            // qx = -127
      x[2 * static_cast<size_t>(K) + i] = k % 2 ? 1.0f : -1.0f;
      x[3 * static_cast<size_t>(K) + i] = k % 3 ? -1.0f : 1.0f;
      x[4 * static_cast<size_t>(K) + i] = 0.0f;
      x[5 * static_cast<size_t>(K) + i] = static_cast<float>(k % 255) - 127.0f;  // every code
    }
    const auto want = reference(w, x, T);
    // The extreme case by hand: row 0 (q = -128, zero 127) times x = +2 (qx = 127).
    const double acc = static_cast<double>(K) * 127.0 * (-128.0 - 127.0);
    ASSERT_LT(std::fabs(acc), 2147483648.0);
    EXPECT_EQ(want[0], static_cast<float>(acc) * (0.0078125f * (2.0f / 127.0f)));
    for (cpu::Isa isa : isas()) {
      const PackedWeight pw = PackedWeight::pack(w.tensor(), &pool);
      std::vector<float> y(want.size());
      cpu::matmul_isa(isa, pool, pw, x.data(), K, y.data(), N, T, scratch);
      expect_bits_equal(want, y, "K=" + std::to_string(K) + " " + isa_name(isa));
    }
  }
}

TEST(MatmulI8Ch, RefusesWeightsTheKernelsCannotTake) {
  ThreadPool pool(1);
  MatmulScratch scratch;
  {
    Weights w = make_weights(2, kI8ChMaxCols + 1, 1, Scheme::random);
    test_util::expect_error([&] { PackedWeight::pack(w.tensor(), &pool, "blk.0.ffn_down.weight"); },
                            ErrorKind::unsupported, {"blk.0.ffn_down.weight", "65537 columns", "65536"});
  }
  Weights w = make_weights(3, 40, 2, Scheme::random);
  for (float z : {0.5f, 128.0f, std::numeric_limits<float>::quiet_NaN()}) {
    I8ChHeader h = i8ch_header(w.row(2));
    h.zero = z;
    std::memcpy(w.bytes.data() + 2 * row_bytes(40), &h, sizeof h);
    test_util::expect_error([&] { PackedWeight::pack(w.tensor(), &pool, "attn_q"); }, ErrorKind::invalid_input,
                            {"attn_q", "row 2", "zero point"});
    std::vector<float> x(40, 1.0f), y(3);
    test_util::expect_error([&] { matmul(pool, w.tensor(), x.data(), y.data(), 1, scratch); },
                            ErrorKind::invalid_input, {"row 2"});
  }
}

// q/k/v of different types in one matmul_multi: each output bit-identical to
// its own matmul, on every instruction set.
TEST(MatmulI8Ch, MultiMixesDtypes) {
  ThreadPool pool(3);
  MatmulScratch scratch;
  const int64_t K = 128;
  Weights q = make_weights(64, K, 1, Scheme::minmax), v = make_weights(40, K, 2, Scheme::random);
  auto kbytes = testing::random_weights(DType::q8_0, 32, K, 3);
  auto fbytes = testing::random_weights(DType::f32, 24, K, 4);
  const PackedWeight pq = PackedWeight::pack(q.tensor()), pv = PackedWeight::pack(v.tensor());
  const PackedWeight pk = PackedWeight::pack(make_tensor(kbytes.data(), DType::q8_0, {32, K}));
  const PackedWeight pf = PackedWeight::pack(make_tensor(fbytes.data(), DType::f32, {24, K}));
  const PackedWeight* ws[] = {&pq, &pk, &pv, &pf};
  for (int64_t T : {1, 5, 37}) {
    const auto x = random_floats(T * K, static_cast<uint32_t>(T));
    for (cpu::Isa isa : isas()) {
      std::vector<std::vector<float>> got(4), own(4);
      std::vector<MatmulOut> outs;
      for (int i = 0; i < 4; ++i) {
        got[static_cast<size_t>(i)].assign(static_cast<size_t>(T * ws[i]->rows()), -1.0f);
        own[static_cast<size_t>(i)].assign(static_cast<size_t>(T * ws[i]->rows()), -2.0f);
        outs.push_back({ws[i], got[static_cast<size_t>(i)].data()});
        cpu::matmul_isa(isa, pool, *ws[i], x.data(), K, own[static_cast<size_t>(i)].data(), ws[i]->rows(), T,
                        scratch);
      }
      cpu::matmul_multi_isa(isa, pool, outs, x.data(), K, T, scratch);
      for (int i = 0; i < 4; ++i)
        expect_bits_equal(own[static_cast<size_t>(i)], got[static_cast<size_t>(i)],
                          std::string(dtype_name(ws[i]->dtype())) + " T=" + std::to_string(T) + " " + isa_name(isa));
      expect_bits_equal(reference(q, x, T), got[0], "q vs reference");
      expect_bits_equal(reference(v, x, T), got[2], "v vs reference");
    }
  }
}

// Against the exact product of the dequantized weights and the quantized
// activations (double): float(acc), scale * s and the last product are the
// only roundings, so the error is at most ~3 ulp of the result; with the f32
// dequantized weights (one more rounding per weight) within 2^-23 sum |w xq|.
TEST(MatmulI8Ch, WithinThreeUlpOfTheDoubleProductOfQuantizedOperands) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  const int64_t N = 45, K = 1536, T = 9;
  for (Scheme s : {Scheme::minmax, Scheme::random}) {
    Weights w = make_weights(N, K, 77, s);
    const auto x = random_floats(T * K, 78);
    std::vector<float> y(static_cast<size_t>(N * T));
    matmul(pool, PackedWeight::pack(w.tensor()), x.data(), y.data(), T, scratch);
    std::vector<int8_t> qx(static_cast<size_t>(K));
    std::vector<float> wf(static_cast<size_t>(K));
    double worst_exact = 0, worst_deq = 0;
    for (int64_t t = 0; t < T; ++t) {
      int32_t xsum;
      const float sx = quantize_act_row_i8ch_ref(x.data() + t * K, K, qx.data(), &xsum);
      for (int64_t n = 0; n < N; ++n) {
        const I8ChHeader h = i8ch_header(w.row(n));
        dequantize_row(DType::i8_ch, w.row(n), wf.data(), K);
        int64_t acc = 0;
        double with_f32_w = 0, mag = 0;
        for (int64_t k = 0; k < K; ++k) {
          const auto i = static_cast<size_t>(k);
          acc += (static_cast<int8_t>(w.row(n)[8 + k]) - static_cast<int64_t>(h.zero)) * qx[i];
          const double xq = static_cast<double>(sx) * qx[i];
          with_f32_w += static_cast<double>(wf[i]) * xq;
          mag += std::fabs(static_cast<double>(wf[i]) * xq);
        }
        // scale * s_x is exact in double (two 24-bit significands): one rounding.
        const double exact = static_cast<double>(h.scale) * static_cast<double>(sx) * static_cast<double>(acc);
        const double got = y[static_cast<size_t>(t * N + n)];
        const double e1 = std::fabs(got - exact), e2 = std::fabs(got - with_f32_w);
        EXPECT_LE(e1, 3.01 * 0x1p-24 * std::fabs(exact) + 1e-37) << "t=" << t << " n=" << n;
        EXPECT_LE(e2, 3.01 * 0x1p-24 * std::fabs(exact) + 0x1p-23 * mag + 1e-37) << "t=" << t << " n=" << n;
        if (exact != 0) worst_exact = std::max(worst_exact, e1 / std::fabs(exact));
        worst_deq = std::max(worst_deq, e2 / mag);
      }
    }
    RecordProperty(s == Scheme::minmax ? "minmax_worst_rel_vs_exact" : "random_worst_rel_vs_exact",
                   std::to_string(worst_exact));
  }
}

// Against the f32 product of the original (unquantized) weights and
// activations: the quantization error of both operands. Measured here (normal
// weights with a per-row outlier, normal activations, K = 2048): printed, and
// bounded loosely. q8_0 of the same weights for comparison.
TEST(MatmulI8Ch, RelativeErrorAgainstTheF32Product) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  const int64_t N = 128, K = 2048, T = 16;
  const auto x = random_floats(T * K, 5);
  for (Scheme s : {Scheme::minmax, Scheme::symmetric}) {
    Weights w = make_weights(N, K, 6, s);
    std::vector<float> y(static_cast<size_t>(N * T));
    matmul(pool, PackedWeight::pack(w.tensor()), x.data(), y.data(), T, scratch);
    std::vector<uint8_t> q8(static_cast<size_t>(N) * dtype_row_bytes(DType::q8_0, K));
    for (int64_t n = 0; n < N; ++n)
      quantize_row_ref(DType::q8_0, w.f32.data() + n * K, q8.data() + static_cast<size_t>(n) * dtype_row_bytes(DType::q8_0, K), K);
    std::vector<float> y8(y.size());
    matmul(pool, make_tensor(q8.data(), DType::q8_0, {N, K}), x.data(), y8.data(), T, scratch);
    double num = 0, num8 = 0, den = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        double ref = 0;
        for (int64_t k = 0; k < K; ++k)
          ref += static_cast<double>(w.f32[static_cast<size_t>(n * K + k)]) * x[static_cast<size_t>(t * K + k)];
        const auto i = static_cast<size_t>(t * N + n);
        num += (y[i] - ref) * (y[i] - ref);
        num8 += (y8[i] - ref) * (y8[i] - ref);
        den += ref * ref;
      }
    const double rel = std::sqrt(num / den), rel8 = std::sqrt(num8 / den);
    const char* name = s == Scheme::minmax ? "minmax" : "symmetric";
    std::printf("i8_ch (%s scales) vs the f32 product: relative error %.3e (q8_0 of the same weights: %.3e)\n", name,
                rel, rel8);
    RecordProperty(std::string(name) + "_rel_err", std::to_string(rel));
    EXPECT_LT(rel, 2e-2) << name;
  }
}

// ---- the backward through frozen i8_ch weights ----

// dx = dy W: the exact tiles and W^T packed in bf16 give what the same weights
// expanded to f32 give, bit for bit (the expansion is the same dequantize_row);
// the f16 / int8 W^T within the usual tolerances of the exact path.
TEST(LinearBackwardI8Ch, EqualsTheF32ExpansionOfTheWeights) {
  ThreadPool pool(3);
  const int64_t T = 7;
  for (const int64_t K : {int64_t{200}, int64_t{576}}) {
    // N = 128 rows in all, so that the int8 precision's W^T is q8_0 (N % 32 == 0).
    Weights a = make_weights(96, K, 31, Scheme::minmax), b = make_weights(32, K, 32, Scheme::random);
    const int64_t N = a.N + b.N;
    const Tensor parts[] = {a.tensor(), b.tensor()};
    // The same rows as f32: [a; b].
    std::vector<float> f32(static_cast<size_t>(N * K));
    for (int64_t n = 0; n < N; ++n)
      dequantize_row(DType::i8_ch, n < a.N ? a.row(n) : b.row(n - a.N), f32.data() + n * K, K);
    const Tensor F = make_tensor(f32.data(), DType::f32, {N, K});
    std::vector<uint8_t> cat(a.bytes);
    cat.insert(cat.end(), b.bytes.begin(), b.bytes.end());
    const Tensor W = make_tensor(cat.data(), DType::i8_ch, {N, K});

    const auto dy = random_floats(T * N, 8, 1e-3f), init = random_floats(T * K, 9);
    std::vector<float> exact_i8 = init, exact_f32 = init;
    linear_backward_input(pool, W, dy.data(), exact_i8.data(), T);
    linear_backward_input(pool, F, dy.data(), exact_f32.data(), T);
    expect_bits_equal(exact_f32, exact_i8, "exact K=" + std::to_string(K));

    const Tensor fparts[] = {F};
    const PackedWeight bf_i8 = pack_transposed(pool, parts, TransposedPrecision::bf16);
    const PackedWeight bf_f32 = pack_transposed(pool, fparts, TransposedPrecision::bf16);
    ASSERT_EQ(bf_i8.nbytes(), bf_f32.nbytes());
    EXPECT_EQ(std::memcmp(bf_i8.panel(0), bf_f32.panel(0), bf_i8.nbytes()), 0);
    PackedBackwardScratch scratch;
    std::vector<float> g_i8 = init, g_f32 = init;
    linear_backward_input_packed(pool, bf_i8, dy.data(), N, g_i8.data(), T, true, scratch);
    linear_backward_input_packed(pool, bf_f32, dy.data(), N, g_f32.data(), T, true, scratch);
    expect_bits_equal(g_f32, g_i8, "bf16 K=" + std::to_string(K));

    // Gradient-only comparisons (dx - init) against the exact path.
    auto rel = [&](const std::vector<float>& got) {
      double d = 0, m = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const double want = static_cast<double>(exact_f32[i]) - init[i];
        d = std::max(d, std::fabs(static_cast<double>(got[i]) - init[i] - want));
        m = std::max(m, std::fabs(want));
      }
      return d / m;
    };
    EXPECT_LT(rel(g_i8), 1e-2) << "bf16";
    for (TransposedPrecision p : {TransposedPrecision::f16, TransposedPrecision::int8}) {
      const PackedWeight Wt = pack_transposed(pool, parts, p);
      EXPECT_EQ(Wt.dtype(), transposed_weight_dtype(DType::i8_ch, N, p));
      std::vector<float> g = init;
      linear_backward_input_packed(pool, Wt, dy.data(), N, g.data(), T, true, scratch);
      EXPECT_LT(rel(g), p == TransposedPrecision::f16 ? 2e-3 : 3e-2) << static_cast<int>(p);
    }
  }
}

}  // namespace
}  // namespace loom
