// NF4 (kernels/ref/nf4_ref.h) against bitsandbytes itself: the fixture
// tests/fixtures/nf4/blocks.safetensors was made by quantize_4bit /
// dequantize_4bit of the real library (scripts/fixtures/make_nf4_fixtures.py).
// Then the production kernels against the scalar reference: dequantize_row and
// the AVX2 / AVX-512 matmul panels, bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/half.h"
#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "kernels/cpu/dequant.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/panel.h"
#include "kernels/ref/dequant_ref.h"
#include "kernels/ref/nf4_ref.h"

namespace loom {
namespace {

std::string fixture(const std::string& f) { return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/nf4/" + f; }

template <class T>
std::vector<T> read(const safetensors::File& f, const char* name) {
  const auto* t = f.find_tensor(name);
  EXPECT_NE(t, nullptr) << name;
  std::vector<T> v(t->nbytes() / sizeof(T));
  std::memcpy(v.data(), t->data, t->nbytes());
  return v;
}

struct Fixture {
  std::unique_ptr<safetensors::File> f = safetensors::File::open(fixture("blocks.safetensors"));
  std::vector<float> src = read<float>(*f, "src"), absmax = read<float>(*f, "absmax"), deq = read<float>(*f, "deq");
  std::vector<float> nested_absmax = read<float>(*f, "nested_absmax"), nested_code = read<float>(*f, "nested_code");
  std::vector<float> code = read<float>(*f, "code"), offset = read<float>(*f, "offset");
  std::vector<uint8_t> packed = read<uint8_t>(*f, "packed"), qabsmax = read<uint8_t>(*f, "qabsmax");
  static constexpr int64_t kRows = 48, kCols = 640;
  int64_t blocks() const { return kRows * kCols / kNf4Block; }
};

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (float_to_bits(a[i]) != float_to_bits(b[i]) && bad++ < 5)
      ADD_FAILURE() << what << " [" << i << "]: " << a[i] << " vs " << b[i];
  EXPECT_EQ(bad, 0u) << what;
}

TEST(Nf4, TablesEqualBitsandbytes) {
  Fixture fx;
  expect_same_bits(fx.code, std::vector<float>(kNf4Code, kNf4Code + 16), "NF4 code");
  expect_same_bits(fx.nested_code, std::vector<float>(kDynamicSignedMap, kDynamicSignedMap + 256), "dynamic map");
}

TEST(Nf4, DTypeIsLoomsOwn) {
  EXPECT_FALSE(dtype_traits_of_id(static_cast<uint32_t>(DType::nf4)).has_value());  // never from a GGUF file
  EXPECT_EQ(dtype_from_name("NF4"), DType::nf4);
  EXPECT_EQ(dtype_block_size(DType::nf4), 64);
  EXPECT_EQ(dtype_row_bytes(DType::nf4, 640), 10u * 36u);
  EXPECT_TRUE(matmul_supports(DType::nf4));
}

// Double quantization's absmax, rebuilt from the 8-bit codes: dequantize_blockwise + offset.
TEST(Nf4, DoubleQuantAbsmaxEqualsBitsandbytes) {
  Fixture fx;
  std::vector<float> got(static_cast<size_t>(fx.blocks()));
  for (int64_t i = 0; i < fx.blocks(); ++i)
    got[static_cast<size_t>(i)] = dequantize_absmax(fx.nested_code.data(), fx.qabsmax[static_cast<size_t>(i)],
                                                    fx.nested_absmax[static_cast<size_t>(i / 256)], fx.offset[0]);
  expect_same_bits(got, fx.absmax, "absmax");
}

std::vector<BlockNF4> blocks_from_fixture(const Fixture& fx) {
  std::vector<BlockNF4> b(static_cast<size_t>(fx.blocks()));
  for (size_t i = 0; i < b.size(); ++i) {
    b[i].d = fx.absmax[i];
    std::memcpy(b[i].qs, fx.packed.data() + 32 * i, 32);
  }
  return b;
}

TEST(Nf4, DequantizeEqualsBitsandbytes) {
  Fixture fx;
  const auto b = blocks_from_fixture(fx);
  std::vector<float> ref(fx.src.size()), cpu(fx.src.size());
  dequantize_row_ref(DType::nf4, b.data(), ref.data(), static_cast<int64_t>(ref.size()));
  expect_same_bits(ref, fx.deq, "dequantize_row_ref");
  // Row by row, from an unaligned source, as the backward's tiles read it.
  std::vector<uint8_t> odd(b.size() * sizeof(BlockNF4) + 1);
  std::memcpy(odd.data() + 1, b.data(), b.size() * sizeof(BlockNF4));
  const size_t row_bytes = dtype_row_bytes(DType::nf4, Fixture::kCols);
  for (int64_t r = 0; r < Fixture::kRows; ++r)
    dequantize_row(DType::nf4, odd.data() + 1 + r * row_bytes, cpu.data() + r * Fixture::kCols, Fixture::kCols);
  expect_same_bits(cpu, fx.deq, "dequantize_row");
}

TEST(Nf4, QuantizeEqualsBitsandbytes) {
  Fixture fx;
  std::vector<BlockNF4> b(static_cast<size_t>(fx.blocks()));
  quantize_tensor_nf4(Fixture::kRows, Fixture::kCols, [&](int64_t r) { return fx.src.data() + r * Fixture::kCols; },
                      b.data());
  std::vector<uint8_t> codes(fx.packed.size());
  std::vector<float> d(b.size());
  for (size_t i = 0; i < b.size(); ++i) {
    std::memcpy(codes.data() + 32 * i, b[i].qs, 32);
    d[i] = b[i].d;
  }
  EXPECT_EQ(codes, fx.packed);
  expect_same_bits(d, fx.absmax, "double-quantized absmax");

  // The double quantization's parts one by one.
  std::vector<float> raw(b.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    uint8_t qs[32];
    raw[i] = quantize_block_nf4(fx.src.data() + 64 * i, qs);
  }
  const Nf4DoubleQuant q = double_quantize_absmax(raw.data(), static_cast<int64_t>(raw.size()));
  EXPECT_EQ(float_to_bits(q.offset), float_to_bits(fx.offset[0]));
  EXPECT_EQ(q.qabsmax, fx.qabsmax);
  expect_same_bits(q.nested_absmax, fx.nested_absmax, "nested absmax");
}

// Random nf4 weights (normal data of row-dependent scale, an all-zero row).
std::vector<BlockNF4> random_nf4(int64_t N, int64_t K, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(N * K));
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < K; ++k) x[static_cast<size_t>(r * K + k)] = r == 2 ? 0.0f : dist(rng) * 0.02f * (1 + r % 7);
  std::vector<BlockNF4> w(static_cast<size_t>(N * K / 64));
  quantize_tensor_nf4(N, K, [&](int64_t r) { return x.data() + r * K; }, w.data());
  return w;
}

Tensor view(std::vector<BlockNF4>& w, int64_t N, int64_t K) {
  Tensor t;
  t.data = w.data();
  t.dtype = DType::nf4;
  t.ndim = 2;
  t.shape = {N, K, 0, 0};
  return t;
}

TEST(Nf4, MatmulEqualsScalarReference) {
  std::vector<cpu::Isa> isas = {cpu::Isa::avx2};
  if (cpu_features().has_avx512_kernels()) isas.push_back(cpu::Isa::avx512);
  for (const auto& [N, K] : {std::pair<int64_t, int64_t>{16, 64}, {37, 576}, {70, 192}}) {
    auto w = random_nf4(N, K, static_cast<uint32_t>(N * 31 + K));
    const Tensor W = view(w, N, K);
    for (int threads : {1, 2}) {
      ThreadPool pool(threads);
      const PackedWeight P = PackedWeight::pack(W, &pool, "w");
      for (int64_t T : {1, 3, 8, 13}) {
        std::mt19937 rng(static_cast<uint32_t>(T));
        std::normal_distribution<float> dist;
        std::vector<float> x(static_cast<size_t>(T * K));
        for (auto& v : x) v = dist(rng);
        std::vector<float> ref(static_cast<size_t>(T * N));
        matmul_nf4_ref(w.data(), N, K, x.data(), T, ref.data());
        for (cpu::Isa isa : isas) {
          MatmulScratch scratch;
          std::vector<float> y(ref.size(), NAN), fly(ref.size(), NAN);
          cpu::matmul_isa(isa, pool, P, x.data(), K, y.data(), N, T, scratch);
          cpu::matmul_isa(isa, pool, W, x.data(), K, fly.data(), N, T, scratch);
          SCOPED_TRACE(testing::Message() << "N=" << N << " K=" << K << " T=" << T << " threads=" << threads
                                          << " isa=" << static_cast<int>(isa));
          expect_same_bits(y, ref, "packed");
          expect_same_bits(fly, ref, "on the fly");
        }
      }
    }
  }
}

// The product is the dequantized weights' product up to f32 rounding.
TEST(Nf4, MatmulCloseToDequantizedProduct) {
  const int64_t N = 48, K = 256, T = 5;
  auto w = random_nf4(N, K, 7);
  std::vector<float> deq(static_cast<size_t>(N * K));
  dequantize_row_ref(DType::nf4, w.data(), deq.data(), N * K);
  std::vector<float> x(static_cast<size_t>(T * K));
  std::mt19937 rng(3);
  std::normal_distribution<float> dist;
  for (auto& v : x) v = dist(rng);
  ThreadPool pool(1);
  MatmulScratch scratch;
  std::vector<float> y(static_cast<size_t>(T * N));
  matmul(pool, PackedWeight::pack(view(w, N, K), &pool), x.data(), y.data(), T, scratch);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double exact = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        exact += static_cast<double>(deq[n * K + k]) * x[t * K + k];
        mag += std::fabs(static_cast<double>(deq[n * K + k]) * x[t * K + k]);
      }
      EXPECT_NEAR(y[t * N + n], exact, 1e-6 * mag + 1e-30) << t << "," << n;
    }
}

}  // namespace
}  // namespace loom
