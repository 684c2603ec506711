// The server's adapter pool (serve/adapter_registry.h) under a memory budget:
// the resident adapters' bytes never pass --max-lora-memory, the least recently
// used adapter goes first, an adapter a running sequence holds is never
// evicted (the request waits instead), thousands of names can be registered
// while a few stay resident, and bf16 storage (--lora-bits 16) halves an
// adapter's bytes and keeps exactly the bf16 values of its weights.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <string>

#include "core/half.h"
#include "kernels/lora_b16.h"
#include "kernels/lora_i8.h"
#include "model/peft_adapter.h"
#include "model_test_util.h"
#include "serve/adapter_registry.h"
#include "serve/engine_api.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

ModelConfig tiny_config() { return test::tiny_llama_config(); }

struct AdapterFolders {
  fs::path root;
  AdapterFolders() {
    root = fs::temp_directory_path() / ("loom_adapter_pool_test_" + std::to_string(::getpid()));
    fs::remove_all(root);
    fs::create_directories(root);
  }
  ~AdapterFolders() { fs::remove_all(root); }

  // A random rank-r adapter on every target; returns its folder.
  std::string write(const std::string& name, uint32_t seed, int64_t r = 4) const {
    const std::string dir = (root / name).string();
    test::write_tiny_random_adapter(dir, seed, r);
    return dir;
  }
};

// Bytes of the r = 4 adapter above in f32: 2 layers x r x (the seven ins + outs: 560 + 608).
constexpr size_t kF32Bytes = 2 * 4 * (560 + 608) * sizeof(float);

TEST(AdapterPool, ByteBudgetIsRespectedWithLeastRecentlyUsedEviction) {
  AdapterFolders d;
  const ModelConfig c = tiny_config();
  // Room for two adapters by bytes (2.5 of them), none by count.
  AdapterRegistry reg(c, {}, /*max_resident=*/1 << 20, 32, kF32Bytes * 5 / 2);
  for (int i = 0; i < 4; ++i) reg.add(fmt::format("a{}", i), d.write(fmt::format("a{}", i), 10 + i), false);
  EXPECT_EQ(reg.resident_count(), 2);
  EXPECT_LE(reg.resident_bytes(), kF32Bytes * 5 / 2);
  for (const AdapterInfo& a : reg.list()) {
    if (a.resident) {
      EXPECT_EQ(a.bytes, kF32Bytes) << a.name;
    }
  }
  auto resident = [&] {
    std::set<std::string> s;
    for (const AdapterInfo& a : reg.list())
      if (a.resident) s.insert(a.name);
    return s;
  };
  EXPECT_EQ(resident(), (std::set<std::string>{"a2", "a3"}));  // registration evicts the oldest
  ASSERT_TRUE(reg.acquire("a2").value());                    // a2 now the most recently used
  ASSERT_TRUE(reg.acquire("a0").value());                    // evicts a3, the least recently used
  EXPECT_EQ(resident(), (std::set<std::string>{"a0", "a2"}));
  ASSERT_TRUE(reg.acquire("a1").value());  // evicts a2
  EXPECT_EQ(resident(), (std::set<std::string>{"a0", "a1"}));
  EXPECT_LE(reg.resident_bytes(), kF32Bytes * 5 / 2);
}

TEST(AdapterPool, AnAdapterInUseIsNeverEvicted) {
  AdapterFolders d;
  const ModelConfig c = tiny_config();  // the registry keeps a reference
  AdapterRegistry reg(c, {}, 1 << 20, 32, kF32Bytes * 2);
  for (int i = 0; i < 3; ++i) reg.add(fmt::format("a{}", i), d.write(fmt::format("a{}", i), 20 + i), false);
  auto held0 = reg.acquire("a1").value();  // a running sequence holds a1 and a2
  auto held1 = reg.acquire("a2").value();
  ASSERT_TRUE(held0 && held1);
  const auto busy = reg.acquire("a0");  // no room beside them: the caller waits
  ASSERT_TRUE(busy.has_value());
  EXPECT_FALSE(*busy);
  EXPECT_EQ(reg.resident_count(), 2);
  held1.reset();  // a2's request finished
  const auto a0 = reg.acquire("a0").value();
  ASSERT_TRUE(a0);
  std::set<std::string> resident;
  for (const AdapterInfo& a : reg.list())
    if (a.resident) resident.insert(a.name);
  EXPECT_EQ(resident, (std::set<std::string>{"a0", "a1"}));
  EXPECT_EQ(held0->name, "a1");
  // A held adapter unregistered meanwhile stays valid for its holder.
  reg.remove("a1");
  EXPECT_FALSE(held0->view.pairs.empty());
  EXPECT_FALSE(reg.acquire("a1").has_value());
}

// Thousands of names over a few folders: registering reads and validates each
// but keeps only what fits; acquiring in any order keeps the budget, reloads
// evicted ones with a new load id each time and returns the adapter asked for.
TEST(AdapterPool, ThousandsRegisteredFewResident) {
  AdapterFolders d;
  const int kFolders = 8, kNames = 2000;
  std::vector<std::string> dirs;
  for (int i = 0; i < kFolders; ++i) dirs.push_back(d.write(fmt::format("f{}", i), 40 + i));
  const ModelConfig c = tiny_config();  // the registry keeps a reference
  AdapterRegistry reg(c, {}, 1 << 20, 16, kF32Bytes / 2 * 6);  // 6 bf16 adapters
  for (int i = 0; i < kNames; ++i) reg.add(fmt::format("n{}", i), dirs[static_cast<size_t>(i % kFolders)], false);
  EXPECT_EQ(reg.list().size(), static_cast<size_t>(kNames));
  EXPECT_EQ(reg.resident_count(), 6);
  std::mt19937 rng(5);
  std::set<int64_t> ids;
  int64_t loads = 0;
  for (int k = 0; k < 300; ++k) {
    const int i = static_cast<int>(rng() % kNames);
    const auto a = reg.acquire(fmt::format("n{}", i)).value();
    ASSERT_TRUE(a);
    EXPECT_EQ(a->name, fmt::format("n{}", i));
    EXPECT_EQ(a->path, dirs[static_cast<size_t>(i % kFolders)]);
    if (ids.insert(a->id).second) ++loads;
    EXPECT_LE(reg.resident_bytes(), kF32Bytes / 2 * 6);
    EXPECT_LE(reg.resident_count(), 6);
  }
  EXPECT_GT(loads, 250);  // nearly every pick was a load of an evicted name, each with its own id
}

TEST(AdapterPool, AdapterLargerThanTheBudgetIsRefused) {
  AdapterFolders d;
  const ModelConfig c = tiny_config();  // the registry keeps a reference
  AdapterRegistry reg(c, {}, 8, 32, kF32Bytes - 1);
  try {
    reg.add("big", d.write("big", 7), false);
    FAIL() << "no error";
  } catch (const EngineError& e) {
    EXPECT_EQ(e.code(), EngineErrc::adapter_load_failed);
    EXPECT_NE(std::string(e.what()).find("--max-lora-memory"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(reg.contains("big"));
}

// --lora-bits 16: half the bytes, every factor the bf16 rounding of its f32
// value (q/k B rows in the model's order, as the f32 view has them).
TEST(AdapterPool, Bf16AdaptersKeepTheRoundedWeightsInHalfTheBytes) {
  AdapterFolders d;
  const std::string dir = d.write("a", 77, 8);
  const ModelConfig c = tiny_config();
  AdapterRegistry f32(c, {}, 8, 32), bf16(c, {}, 8, 16);
  f32.add("a", dir, false);
  bf16.add("a", dir, false);
  const auto x = f32.acquire("a").value(), h = bf16.acquire("a").value();
  ASSERT_TRUE(x && h);
  EXPECT_EQ(h->bytes * 2, x->bytes);
  EXPECT_EQ(h->f32_bytes, x->bytes);
  EXPECT_EQ(h->tensors.mapping, nullptr);  // the file is no longer mapped
  size_t checked = 0;
  for (size_t i = 0; i < x->view.pairs.size(); ++i) {
    const ServeLoraPair& p = x->view.pairs[i];
    const ServeLoraPair& q = h->view.pairs[i];
    ASSERT_EQ(p.present(), q.present());
    if (!p.present()) continue;
    ASSERT_TRUE(q.bf16());
    EXPECT_EQ(q.a.data, nullptr);
    EXPECT_EQ(q.rank(), p.rank());
    const float* a = static_cast<const float*>(p.a.data);
    const float* b = static_cast<const float*>(p.b.data);
    for (int64_t e = 0; e < p.a.numel(); ++e, ++checked) ASSERT_EQ(q.a16[e], fp32_to_bf16(a[e]));
    const int64_t out = p.b.dim(0), r = p.rank();
    for (int64_t e = 0; e < p.b.numel(); ++e, ++checked)
      ASSERT_EQ(q.b16[lora_b16_index(out, r, e / r, e % r)], fp32_to_bf16(b[e]));
  }
  EXPECT_EQ(checked * sizeof(float), x->bytes);
}

// --lora-bits 8: each factor kept as kernels/lora_i8.h packs its f32 value
// (q/k B rows in the model's order), in a quarter of the bytes plus the scales,
// the file no longer mapped.
TEST(AdapterPool, Int8AdaptersKeepTheirCodesInAQuarterOfTheBytes) {
  AdapterFolders d;
  const std::string dir = d.write("a", 78, 8);
  const ModelConfig c = tiny_config();
  AdapterRegistry f32(c, {}, 8, 32), i8(c, {}, 8, 8);
  f32.add("a", dir, false);
  i8.add("a", dir, false);
  const auto x = f32.acquire("a").value(), q8 = i8.acquire("a").value();
  ASSERT_TRUE(x && q8);
  EXPECT_EQ(q8->f32_bytes, x->bytes);
  EXPECT_LT(q8->bytes * 3, x->bytes);  // a quarter, plus one f32 scale per row of A and per 64 values of B
  EXPECT_EQ(q8->tensors.mapping, nullptr);
  size_t pairs = 0;
  for (size_t i = 0; i < x->view.pairs.size(); ++i) {
    const ServeLoraPair& p = x->view.pairs[i];
    const ServeLoraPair& q = q8->view.pairs[i];
    ASSERT_EQ(p.present(), q.present());
    if (!p.present()) continue;
    ASSERT_TRUE(q.int8());
    EXPECT_EQ(q.a.data, nullptr);
    EXPECT_EQ(q.b.data, nullptr);
    const int64_t r = p.rank(), in = p.a.dim(1), out = p.b.dim(0);
    std::vector<uint8_t> a8(lora_a8_bytes(r, in)), b8(lora_b8_bytes(out, r));
    pack_lora_a8(static_cast<const float*>(p.a.data), r, in, a8.data());
    pack_lora_b8(static_cast<const float*>(p.b.data), out, r, b8.data());
    EXPECT_EQ(0, std::memcmp(q.a8, a8.data(), a8.size())) << "pair " << i;
    EXPECT_EQ(0, std::memcmp(q.b8, b8.data(), b8.size())) << "pair " << i;
    ++pairs;
  }
  EXPECT_GT(pairs, 0u);
}

}  // namespace
}  // namespace loom
