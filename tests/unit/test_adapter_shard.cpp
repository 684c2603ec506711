// A served adapter cut for tensor parallel (serve/adapter_shard.h, `loom serve
// --tp N`): each rank's part computes its share of the whole adapter's
// product (q/k/v/gate/up: its rows of B A x, exactly; o/down: partial sums
// that add up to B A x), the q/k rows permuted for a RoPE-interleaved model
// after the cut as before it; AdapterRegistry with tp_ranks keeps rank 0's
// part and the followers' parts, in any --lora-bits; in 4 bits a part whose
// columns are whole groups keeps exactly one process's values.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/int_quant.h"
#include "model/peft_adapter.h"
#include "model/tensor_parallel.h"
#include "model_test_util.h"
#include "serve/adapter_registry.h"
#include "serve/adapter_shard.h"

namespace loom {
namespace {

// The tiny llama's shapes (tests/fixtures/model/tiny-llama.f32.gguf), RoPE-interleaved as from GGUF.
ModelConfig tiny_config() {
  ModelConfig c = test::tiny_llama_config();
  c.rope_layout = RopeLayout::interleaved;
  return c;
}

// A random rank-r adapter on every target of `c`, with distinct values everywhere.
peft::AdapterTensors random_adapter(const ModelConfig& c, int64_t r, uint32_t seed) {
  peft::AdapterTensors t;
  t.config.r = static_cast<int>(r);
  t.config.lora_alpha = 8;
  for (LoraTarget target : kAllLoraTargets) t.config.target_modules.push_back(target);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.5f);
  for (int l = 0; l < c.n_layers; ++l)
    for (LoraTarget target : kAllLoraTargets) {
      peft::LoraPair p;
      p.in = lora_target_in(c, target);
      p.out = lora_target_out(c, target);
      p.a.resize(static_cast<size_t>(r * p.in));
      p.b.resize(static_cast<size_t>(p.out * r));
      for (float& v : p.a) v = nd(rng);
      for (float& v : p.b) v = nd(rng);
      t.pairs.emplace(std::make_pair(l, target), std::move(p));
    }
  return t;
}

// y = B (A x) in double, from f32 views.
std::vector<double> product(const ServeLoraPair& p, const float* x) {
  const int64_t r = p.rank(), in = p.a.dim(1), out = p.b.dim(0);
  const float* a = p.a.as<const float>();
  const float* b = p.b.as<const float>();
  std::vector<double> u(static_cast<size_t>(r)), y(static_cast<size_t>(out));
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < in; ++j) u[static_cast<size_t>(i)] += static_cast<double>(a[i * in + j]) * x[j];
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < r; ++i)
      y[static_cast<size_t>(o)] += static_cast<double>(b[o * r + i]) * u[static_cast<size_t>(i)];
  return y;
}

TEST(AdapterShard, PartsComputeTheWholeProduct) {
  const ModelConfig full = tiny_config();
  const peft::AdapterTensors t = random_adapter(full, 4, 7);
  const AdapterShard whole_shard = make_adapter_shard(t, full, 0, 1);
  const ServeAdapter whole = adapter_shard_view(whole_shard, full);
  const int ranks = 2;
  const ModelConfig shard = tensor_parallel_config(full, ranks);
  std::vector<AdapterShard> parts;
  std::vector<ServeAdapter> views;
  for (int k = 0; k < ranks; ++k) parts.push_back(make_adapter_shard(t, full, k, ranks));
  for (int k = 0; k < ranks; ++k) views.push_back(adapter_shard_view(parts[static_cast<size_t>(k)], shard));
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t l = 0; l < full.n_layers; ++l)
    for (LoraTarget target : kAllLoraTargets) {
      SCOPED_TRACE(fmt::format("layer {} {} over {} ranks", l, lora_target_peft_name(target), ranks));
      const int64_t in = lora_target_in(full, target), out = lora_target_out(full, target);
      std::vector<float> x(static_cast<size_t>(in));
      for (float& v : x) v = nd(rng);
      const std::vector<double> y = product(whole.pair(l, target), x.data());
      if (lora_target_row_parallel(target)) {  // each rank reads its slice of x; the parts sum to y
        const int64_t in_s = in / ranks;
        std::vector<double> sum(static_cast<size_t>(out));
        for (int k = 0; k < ranks; ++k) {
          const ServeLoraPair& p = views[static_cast<size_t>(k)].pair(l, target);
          ASSERT_EQ(p.a.dim(1), in_s);
          ASSERT_EQ(p.b.dim(0), out);
          const std::vector<double> yk = product(p, x.data() + k * in_s);
          for (int64_t o = 0; o < out; ++o) sum[static_cast<size_t>(o)] += yk[static_cast<size_t>(o)];
        }
        for (int64_t o = 0; o < out; ++o)
          EXPECT_NEAR(sum[static_cast<size_t>(o)], y[static_cast<size_t>(o)], 1e-9);
      } else {  // each rank writes its rows of y, in the model's row order
        const int64_t out_s = out / ranks;
        for (int k = 0; k < ranks; ++k) {
          const ServeLoraPair& p = views[static_cast<size_t>(k)].pair(l, target);
          ASSERT_EQ(p.a.dim(1), in);
          ASSERT_EQ(p.b.dim(0), out_s);
          const std::vector<double> yk = product(p, x.data());
          for (int64_t o = 0; o < out_s; ++o)
            EXPECT_EQ(yk[static_cast<size_t>(o)], y[static_cast<size_t>(k * out_s + o)]);
        }
      }
    }
}

TEST(AdapterShard, QkRowsArePermutedForTheModel) {
  // The whole "part" (one rank) of a q B equals PEFT's B with lora_permute_qk_rows applied.
  const ModelConfig full = tiny_config();
  const peft::AdapterTensors t = random_adapter(full, 2, 3);
  const ServeAdapter whole = adapter_shard_view(make_adapter_shard(t, full, 0, 1), full);
  const peft::LoraPair& q = t.pairs.at({1, LoraTarget::q});
  std::vector<float> b(q.b.begin(), q.b.end());
  lora_permute_qk_rows(make_tensor(b.data(), DType::f32, {q.out, 2}), full.n_heads, full.head_dim, true);
  const float* got = whole.pair(1, LoraTarget::q).b.as<const float>();
  for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(got[i], b[i]) << i;
  ASSERT_NE(b, q.b);  // the permutation moved rows (else this would prove nothing)
}

TEST(AdapterShard, SlotsOutsideTheModelAreRefused) {
  const ModelConfig shard = tensor_parallel_config(tiny_config(), 2);
  const std::vector<int64_t> ok_slots = {0, 13}, ranks = {4, 4};
  EXPECT_EQ(
      adapter_shard_floats(ok_slots, ranks, shard),
      static_cast<size_t>(4 * (64 + 32) + 4 * (88 + 64)));  // layer 0 q: 64 -> 32; layer 1 down: 88 -> 64
  const std::vector<int64_t> bad_slot = {0, 14};
  EXPECT_THROW(adapter_shard_floats(bad_slot, ranks, shard), Error);
  const std::vector<int64_t> bad_rank = {4, 0};
  EXPECT_THROW(adapter_shard_floats(ok_slots, bad_rank, shard), Error);
}

TEST(AdapterShard, RegistryKeepsRankZerosPartAndCutsTheFollowers) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("loom_adapter_shard_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  test::write_tiny_random_adapter(dir.string(), 5);
  const ModelConfig full = tiny_config();
  const ModelConfig shard = tensor_parallel_config(full, 2);
  const peft::AdapterTensors t = peft::read_adapter(dir.string());
  const AdapterShard want0 = make_adapter_shard(t, full, 0, 2), want1 = make_adapter_shard(t, full, 1, 2);
  for (int bits : {32, 16, 8, 4}) {
    SCOPED_TRACE(fmt::format("--lora-bits {}", bits));
    AdapterRegistry reg(full, {}, 8, bits, 0, /*tp_ranks=*/2);
    reg.add("a", dir.string(), /*runtime=*/false);
    const auto a = reg.acquire("a");
    ASSERT_TRUE(a && *a);
    const LoadedAdapter& la = **a;
    ASSERT_EQ(la.follower_shards.size(), 1u);
    EXPECT_EQ(la.follower_shards[0].data, want1.data);
    EXPECT_EQ(la.follower_shards[0].slots, want1.slots);
    EXPECT_EQ(la.f32_bytes, want0.data.size() * sizeof(float));  // one rank's part, not the whole
    const ServeAdapter v0 = adapter_shard_view(want0, shard);
    for (size_t i = 0; i < v0.pairs.size(); ++i) {
      const ServeLoraPair &got = la.view.pairs[i], &want = v0.pairs[i];
      ASSERT_EQ(got.present(), want.present());
      if (!want.present()) continue;
      EXPECT_EQ(got.a.shape_string(), want.a.shape_string());
      EXPECT_EQ(got.b.shape_string(), want.b.shape_string());
      if (bits == 32) {
        EXPECT_EQ(0, std::memcmp(got.a.data, want.a.data, static_cast<size_t>(want.a.numel()) * 4));
        EXPECT_EQ(0, std::memcmp(got.b.data, want.b.data, static_cast<size_t>(want.b.numel()) * 4));
      }
      EXPECT_EQ(got.bf16(), bits == 16);
      EXPECT_EQ(got.int8(), bits == 8);
      EXPECT_EQ(got.quantized(), bits == 4);
    }
  }
  fs::remove_all(dir);
}

// f32 values of a 4-bit matrix [rows, cols] as the LoRA kernel computes with them.
std::vector<float> dequantized(const Int4Rows& m, int64_t rows, int64_t cols) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  unpack_int4_rows(m.codes, m.scales, rows, cols, m.group, out.data());
  return out;
}

TEST(AdapterShard, FourBitPartsKeepOneProcesssValuesOnGroupBounds) {
  // o's A has 256 columns in groups of 128 and down's 512 in groups of 128: each of 2 ranks' parts is
  // whole groups, so every part is exactly its cut of one process's 4-bit values (A and B alike): a
  // part's own group (fitting_int4_group of its columns) is then one process's, since any larger
  // candidate dividing the part's columns would divide the whole row's too.
  ModelConfig full = tiny_config();
  full.n_layers = 1;
  full.n_heads = 8;
  full.head_dim = 32;
  full.intermediate = 512;
  const ModelConfig shard = tensor_parallel_config(full, 2);
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("loom_adapter_shard_4bit_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  peft::write_adapter(dir.string(), random_adapter(full, 4, 9));
  AdapterRegistry one(full, {}, 8, 4), tp(full, {}, 8, 4, 0, /*tp_ranks=*/2);
  one.add("a", dir.string(), false);
  tp.add("a", dir.string(), false);
  const auto whole = *one.acquire("a"), rank0 = *tp.acquire("a");
  LoadedAdapter rank1;  // as a follower keeps the part rank 0 sends it
  rank1.view = adapter_shard_view(rank0->follower_shards[0], shard);
  keep_adapter_in_bits(rank1, 4);
  const LoadedAdapter* parts[] = {rank0.get(), &rank1};
  for (LoraTarget t : kAllLoraTargets) {
    SCOPED_TRACE(lora_target_peft_name(t));
    const ServeLoraPair& w = whole->view.pair(0, t);
    const int64_t r = 4, in = lora_target_in(full, t), out = lora_target_out(full, t);
    ASSERT_TRUE(w.quantized());
    const std::vector<float> wa = dequantized(w.a4, r, in), wb = dequantized(w.b4, out, r);
    const int64_t in_s = lora_target_in(shard, t), out_s = lora_target_out(shard, t);
    for (int k = 0; k < 2; ++k) {
      const ServeLoraPair& p = parts[k]->view.pair(0, t);
      ASSERT_TRUE(p.quantized());
      const std::vector<float> pa = dequantized(p.a4, r, in_s), pb = dequantized(p.b4, out_s, r);
      const bool by_columns = lora_target_row_parallel(t);
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < in_s; ++j)
          ASSERT_EQ(pa[static_cast<size_t>(i * in_s + j)],
                    wa[static_cast<size_t>(i * in + (by_columns ? k * in_s : 0) + j)]);
      for (int64_t o = 0; o < out_s; ++o)
        for (int64_t i = 0; i < r; ++i)
          ASSERT_EQ(pb[static_cast<size_t>(o * r + i)],
                    wb[static_cast<size_t>(((by_columns ? 0 : k * out_s) + o) * r + i)]);
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace loom
