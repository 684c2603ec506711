// 8-bit AdamW (optim.kind adamw8bit) against the real bitsandbytes 0.50.2 on
// CPU (scripts/fixtures/make_adam8bit_fixtures.py -> tests/fixtures/adam8bit/):
// the dynamic maps, quantize_blockwise / dequantize_blockwise bit for bit, and
// bnb.optim.AdamW8bit steps (codes and absmax equal, parameters to the last bits); the
// CPU kernels against the scalar reference; the optimizer's layout, bytes per
// parameter and state file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/rng.h"
#include "cpu_backend_util.h"
#include "io/safetensors.h"
#include "kernels/blockwise8.h"
#include "kernels/ref/optim8bit_ref.h"
#include "train/optimizer.h"

namespace loom {
namespace {

using Cpu = test_util::CpuBackend;

const std::string kDir = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/adam8bit/";

struct Fixture {
  std::unique_ptr<safetensors::File> file = safetensors::File::open(kDir + "adam8bit.safetensors");
  nlohmann::json meta = nlohmann::json::parse(read_text_file(kDir + "adam8bit.json"));

  template <typename T>
  std::vector<T> get(const std::string& name) const {
    const safetensors::TensorInfo* t = file->find_tensor(name);
    EXPECT_NE(t, nullptr) << name;
    if (!t) return {};
    std::vector<T> out(t->nbytes() / sizeof(T));
    std::memcpy(out.data(), t->data, t->nbytes());
    return out;
  }
};

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::unique_ptr<Blockwise8Map> make_map(bool is_signed) {
  auto m = std::make_unique<Blockwise8Map>();
  build_blockwise8_map(*m, is_signed);
  return m;
}

TEST(Blockwise8, DynamicMapsEqualBitsandbytes) {
  const Fixture f;
  for (bool is_signed : {true, false}) {
    const auto want = f.get<float>(is_signed ? "map_signed" : "map_unsigned");
    const std::array<float, 256> got = dynamic_map(is_signed);
    ASSERT_EQ(want.size(), 256u);
    for (size_t i = 0; i < 256; ++i) EXPECT_EQ(bits(got[i]), bits(want[i])) << "signed " << is_signed << " entry " << i;
  }
}

TEST(Blockwise8, QuantizeDequantizeEqualBitsandbytes) {
  const Fixture f;
  const auto smap = make_map(true), umap = make_map(false);
  for (int threads : {1, 2}) {
    Cpu cpu(threads);
    int cases = 0;
    for (const auto& c : f.meta["quant"]) {
      const std::string name = c["name"];
      const Blockwise8Map& map = c["signed"].get<bool>() ? *smap : *umap;
      const auto src = f.get<float>("q." + name + ".src");
      const auto codes = f.get<uint8_t>("q." + name + ".codes");
      const auto absmax = f.get<float>("q." + name + ".absmax");
      const auto deq = f.get<float>("q." + name + ".deq");
      const size_t n = src.size();
      ASSERT_EQ(absmax.size(), blockwise8_blocks(n)) << name;
      for (int impl = 0; impl < 2; ++impl) {  // 0: the scalar reference, 1: the CPU backend
        std::vector<uint8_t> q(n);
        std::vector<float> am(absmax.size()), out(n);
        if (impl == 0) {
          ref::quantize_blockwise(map, src.data(), n, q.data(), am.data());
          ref::dequantize_blockwise(map, codes.data(), absmax.data(), n, out.data());
        } else {
          cpu.backend->quantize_blockwise(map, src.data(), n, q.data(), am.data());
          cpu.backend->dequantize_blockwise(map, codes.data(), absmax.data(), n, out.data());
        }
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(q[i], codes[i]) << name << " impl " << impl << " element " << i << " value " << src[i];
          ASSERT_EQ(bits(out[i]), bits(deq[i])) << name << " impl " << impl << " element " << i;
        }
        for (size_t b = 0; b < am.size(); ++b) ASSERT_EQ(bits(am[b]), bits(absmax[b])) << name << " block " << b;
      }
      ++cases;
    }
    EXPECT_GE(cases, 8);
  }
}

// The CPU kernel equals the reference for sizes around the vector width and
// block tails, and for inputs with inf / NaN (an inf block absmax) and zeros.
TEST(Blockwise8, CpuKernelEqualsReference) {
  const auto smap = make_map(true);
  Cpu cpu(2);
  CounterRng rng(3);
  for (size_t n : {size_t{1}, size_t{7}, size_t{8}, size_t{255}, size_t{256}, size_t{257}, size_t{1000}, size_t{5003}}) {
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<double>(rng.next_u64() % 20001) / 10000.0 - 1.0);
    if (n > 300) {
      x[3] = std::numeric_limits<float>::quiet_NaN();
      x[260] = std::numeric_limits<float>::infinity();
      for (size_t i = 512; i < std::min(n, size_t{768}); ++i) x[i] = 0.0f;
    }
    std::vector<uint8_t> qa(n), qb(n);
    std::vector<float> aa(blockwise8_blocks(n)), ab(aa.size());
    ref::quantize_blockwise(*smap, x.data(), n, qa.data(), aa.data());
    cpu.backend->quantize_blockwise(*smap, x.data(), n, qb.data(), ab.data());
    EXPECT_EQ(qa, qb) << "n " << n;
    for (size_t b = 0; b < aa.size(); ++b) EXPECT_EQ(bits(aa[b]), bits(ab[b])) << "n " << n << " block " << b;
  }
}

// bnb.optim.AdamW8bit on CPU: a 5000-element tensor (8-bit) and a 1000-element
// one (f32: below min_8bit_size), six steps from the same gradients.
TEST(Adam8bit, MatchesBitsandbytesAdamW8bit) {
  const Fixture f;
  const auto& o = f.meta["opt"];
  const size_t nb = o["big"], ns = o["small"];
  ASSERT_GE(nb, kMin8bitSize);
  ASSERT_LT(ns, kMin8bitSize);
  Cpu cpu(2);
  const double lr = o["lr"];
  AdamWConfig cfg{o["beta1"], o["beta2"], o["eps"], /*max_grad_norm=*/0};
  const std::vector<ParamGroup> groups = {{"all", 0, nb + ns, lr, o["weight_decay"]}};
  AdamW opt(*cpu.backend, cfg, groups, nb + ns, {}, OptimizerKind::adamw8bit, {{0, nb}, {nb, ns}});
  EXPECT_EQ(opt.n_8bit(), nb);
  EXPECT_EQ(opt.exp_avg().size(), ns);
  std::vector<float> params = f.get<float>("opt.param.big.init");
  const auto small0 = f.get<float>("opt.param.small.init");
  params.insert(params.end(), small0.begin(), small0.end());
  const auto parts = opt.state_parts();
  ASSERT_EQ(parts.size(), 6u);
  const auto part = [&](const char* name) {
    for (const auto& p : parts)
      if (std::string(p.file) == name) return p;
    ADD_FAILURE() << name;
    return parts[0];
  };
  int bit_equal = 0;
  const int steps = o["steps"];
  for (int s = 0; s < steps; ++s) {
    const std::string k = std::to_string(s);
    std::vector<float> g = f.get<float>("opt.grad.big." + k);
    const auto gs = f.get<float>("opt.grad.small." + k);
    g.insert(g.end(), gs.begin(), gs.end());
    opt.step(params, g);
    const auto want_m = f.get<uint8_t>("opt.big.state1." + k), want_v = f.get<uint8_t>("opt.big.state2." + k);
    const auto want_am = f.get<float>("opt.big.absmax1." + k), want_av = f.get<float>("opt.big.absmax2." + k);
    ASSERT_EQ(std::memcmp(part("adam_m.q8").data, want_m.data(), nb), 0) << "first-moment codes after step " << s + 1;
    ASSERT_EQ(std::memcmp(part("adam_v.q8").data, want_v.data(), nb), 0) << "second-moment codes after step " << s + 1;
    ASSERT_EQ(std::memcmp(part("adam_m_absmax.f32").data, want_am.data(), want_am.size() * 4), 0) << "step " << s + 1;
    ASSERT_EQ(std::memcmp(part("adam_v_absmax.f32").data, want_av.data(), want_av.size() * 4), 0) << "step " << s + 1;
    // Parameters: bnb's torch ops and loom's kernel differ in the last bit on ~1.5% of elements per step.
    const auto want_p = f.get<float>("opt.param.big." + k);
    for (size_t i = 0; i < nb; ++i) {
      bit_equal += params[i] == want_p[i];
      // a rounding of p * keep + update: relative to the larger term (|update| <= ~lr).
      ASSERT_NEAR(params[i], want_p[i], 4e-7 * (std::fabs(want_p[i]) + lr)) << "big param " << i << " step " << s + 1;
    }
    // The small tensor's f32 moments follow loom's (torch's) AdamW, bnb's 32-bit kernel to rounding.
    const auto want_ps = f.get<float>("opt.param.small." + k), want_m1 = f.get<float>("opt.small.state1." + k);
    for (size_t i = 0; i < ns; ++i) {
      ASSERT_NEAR(params[nb + i], want_ps[i], 1e-6 * std::fabs(want_ps[i]) + 1e-9) << "small param " << i;
      ASSERT_NEAR(opt.exp_avg()[i], want_m1[i], 1e-5 * std::fabs(want_m1[i]) + 1e-9) << "small m " << i;
    }
  }
  EXPECT_GT(bit_equal, static_cast<int>(0.95 * static_cast<double>(nb) * steps));
}

// The fused CPU update equals the scalar reference bit for bit (1 and 2 threads, tails).
TEST(Adam8bit, CpuKernelEqualsReference) {
  const auto smap = make_map(true), umap = make_map(false);
  CounterRng rng(5);
  const auto uniform = [&] { return static_cast<float>(static_cast<double>(rng.next_u64() % 20001) / 10000.0 - 1.0); };
  for (int threads : {1, 2}) {
    Cpu cpu(threads);
    const size_t n = 4096 + 256 * 3 + 77;
    std::vector<float> pa(n), pb;
    for (float& x : pa) x = 0.1f * uniform();
    pb = pa;
    const size_t nblk = blockwise8_blocks(n);
    std::vector<uint8_t> ma(n), va(n), mb(n), vb(n);
    std::vector<float> ama(nblk), ava(nblk), amb(nblk), avb(nblk);
    for (int step = 1; step <= 5; ++step) {
      std::vector<float> g(n);
      for (float& x : g) x = 0.01f * uniform();
      if (step == 1) std::fill_n(g.begin() + 256, 256, 0.0f);
      Adam8bitUpdate u{};
      u.keep = 1.0f - 1e-3f * 0.01f;
      u.step_size = static_cast<float>(1e-3 / (1.0 - std::pow(0.9, step)));
      u.b1 = 0.9f;
      u.w1 = static_cast<float>(1.0 - 0.9);
      u.b2 = 0.999f;
      u.w2 = static_cast<float>(1.0 - 0.999);
      u.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(0.999, step)));
      u.eps = 1e-8f;
      ref::adamw8bit_update(u, pa.data(), g.data(), {ma.data(), ama.data(), va.data(), ava.data(), smap.get(), umap.get()}, n);
      cpu.backend->adamw8bit_update(u, pb.data(), g.data(),
                                    {mb.data(), amb.data(), vb.data(), avb.data(), smap.get(), umap.get()}, n);
      ASSERT_EQ(ma, mb) << "step " << step;
      ASSERT_EQ(va, vb) << "step " << step;
      for (size_t i = 0; i < nblk; ++i) ASSERT_EQ(bits(ama[i]), bits(amb[i])) << i;
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(bits(pa[i]), bits(pb[i])) << "param " << i << " step " << step;
    }
  }
}

// Layout: pieces of groups inside tensors; small ones keep f32; ~2.03 bytes a
// parameter of 8-bit state; the state file round-trips and refuses another kind.
TEST(Adam8bit, LayoutBytesAndStateFile) {
  Cpu cpu;
  const size_t n = 3 * 8192 + 1000;
  const std::vector<ParamGroup> groups = {{"a", 0, 8192, 1e-3, 0.0}, {"b", 8192, 2 * 8192 + 1000, 1e-3, 0.01}};
  const std::vector<TensorSpan> tensors = {{0, 8192}, {8192, 8192}, {16384, 8192}, {24576, 1000}};
  AdamW a(*cpu.backend, {}, groups, n, {}, OptimizerKind::adamw8bit, tensors);
  EXPECT_EQ(a.n_8bit(), 3u * 8192);
  EXPECT_EQ(a.exp_avg().size(), 1000u);
  const double per_param = static_cast<double>(a.state_bytes() - 2 * sizeof(Blockwise8Map) - 8 * 1000) /
                           static_cast<double>(a.n_8bit());
  EXPECT_NEAR(per_param, 2.0 + 8.0 / 256.0, 1e-9);
  EXPECT_LT(per_param, 2.1);
  CounterRng rng(9);
  std::vector<float> p(n, 0.5f), g(n);
  for (int s = 0; s < 3; ++s) {
    for (float& x : g) x = static_cast<float>(static_cast<double>(rng.next_u64() % 1000) / 500.0 - 1.0);
    a.step(p, g);
  }
  const auto dir = std::filesystem::temp_directory_path() / ("loom_opt8_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "opt.bin").string();
  a.save(path);
  AdamW b(*cpu.backend, {}, groups, n, {}, OptimizerKind::adamw8bit, tensors);
  b.load(path);
  EXPECT_EQ(b.step_count(), 3);
  const auto pa = a.state_parts(), pb = b.state_parts();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_EQ(pa[i].bytes, pb[i].bytes);
    EXPECT_EQ(std::memcmp(pa[i].data, pb[i].data, pa[i].bytes), 0) << pa[i].file;
  }
  // The same next step from both.
  std::vector<float> p2 = p;
  a.step(p, g);
  b.step(p2, g);
  EXPECT_EQ(p, p2);
  AdamW f32(*cpu.backend, {}, groups, n);
  try {
    f32.load(path);
    ADD_FAILURE() << "an adamw8bit state loaded into adamw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("adamw8bit"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(Adam8bit, RejectsBadTensors) {
  Cpu cpu;
  const std::vector<ParamGroup> groups = {{"a", 0, 100, 1e-3, 0.0}};
  EXPECT_THROW(AdamW(*cpu.backend, {}, groups, 100, {}, OptimizerKind::adamw8bit, {{0, 101}}), Error);
  EXPECT_THROW(AdamW(*cpu.backend, {}, groups, 100, {}, OptimizerKind::adamw8bit, {{0, 60}, {50, 50}}), Error);
}

}  // namespace
}  // namespace loom
