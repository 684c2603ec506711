// The server's paged KV block manager (serve/kv_pool.h): allocation and
// reference counts, the prefix cache (keys by tokens and adapter, LRU
// eviction), and a random stress test that checks every matched prefix still
// holds the data its owner wrote.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "expect_error.h"
#include "core/thread_pool.h"
#include "kernels/backend.h"
#include "cpu_backend_util.h"
#include "serve/kv_pool.h"

namespace loom {
namespace {

using Cpu = test_util::CpuBackend;

using test_util::expect_error;

ModelConfig tiny_config(int64_t n_layers = 2, int64_t n_kv_heads = 2, int64_t head_dim = 8) {
  ModelConfig c;
  c.n_layers = n_layers;
  c.n_heads = n_kv_heads * 2;
  c.n_kv_heads = n_kv_heads;
  c.head_dim = head_dim;
  c.hidden = c.n_heads * head_dim;
  return c;
}

std::vector<int32_t> iota_tokens(int64_t n, int32_t first = 100) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (size_t i = 0; i < t.size(); ++i) t[i] = first + static_cast<int32_t>(i);
  return t;
}

TEST(KvPool, SizingFromBytes) {
  Cpu cpu;
  const ModelConfig c = tiny_config(3, 2, 8);  // kv_dim 16
  EXPECT_EQ(KvPool::bytes_per_block(c, 16), size_t{2 * 3 * 16 * 16 * 4});
  EXPECT_EQ(KvPool::blocks_for_bytes(c, 10 * KvPool::bytes_per_block(c, 16) + 5, 16), 10);
  EXPECT_EQ(KvPool::blocks_for_bytes(c, 100, 16), 0);
  expect_error([&] { KvPool p(*cpu.backend, c, 0, 16); }, ErrorKind::invalid_input, {"at least one"});
  expect_error([&] { KvPool p(*cpu.backend, c, 4, 0); }, ErrorKind::invalid_input, {"block size"});
  KvPool p(*cpu.backend, c, 7, 5);
  EXPECT_EQ(p.bytes(), 7 * KvPool::bytes_per_block(c, 5));
  // Layers and K/V do not overlap: the last value row of the last layer ends the storage.
  auto f = [](void* x) { return static_cast<float*>(x); };
  EXPECT_EQ(f(p.values(2)) + 7 * 5 * 16, f(p.keys(0)) + p.bytes() / sizeof(float));
  EXPECT_EQ(f(p.keys(1)) - f(p.keys(0)), 7 * 5 * 16);
  // f16 storage: half the bytes, same layout in elements.
  EXPECT_EQ(KvPool::bytes_per_block(c, 16, DType::f16), KvPool::bytes_per_block(c, 16) / 2);
  EXPECT_EQ(KvPool::blocks_for_bytes(c, 10 * KvPool::bytes_per_block(c, 16), 16, DType::f16), 20);
  KvPool h(*cpu.backend, c, 7, 5, DType::f16);
  EXPECT_EQ(h.dtype(), DType::f16);
  EXPECT_EQ(h.bytes(), p.bytes() / 2);
  auto u = [](void* x) { return static_cast<uint16_t*>(x); };
  EXPECT_EQ(u(h.values(2)) + 7 * 5 * 16, u(h.keys(0)) + h.bytes() / 2);
  expect_error([&] { KvPool q(*cpu.backend, c, 4, 16, DType::q8_0); }, ErrorKind::invalid_input,
               {"KV cache type", "q8_0"});
}

TEST(KvPool, ReserveReleaseAndRefCounts) {
  Cpu cpu;
  KvPool p(*cpu.backend, tiny_config(), 10, 4);
  EXPECT_EQ(p.free_blocks(), 10);
  EXPECT_EQ(p.usage(), 0.0);
  BlockTable a, b;
  EXPECT_EQ(p.blocks_needed(a, 9), 3);
  ASSERT_TRUE(p.reserve(a, 9));
  EXPECT_EQ(a.n_blocks(), 3);
  EXPECT_EQ(p.blocks_needed(a, 12), 0);
  EXPECT_EQ(p.blocks_needed(a, 13), 1);
  ASSERT_TRUE(p.reserve(a, 12));  // no new block needed
  EXPECT_EQ(a.n_blocks(), 3);
  EXPECT_EQ(p.free_blocks(), 7);
  EXPECT_DOUBLE_EQ(p.usage(), 0.3);
  for (int32_t blk : a.blocks) EXPECT_EQ(p.ref_count(blk), 1);
  // slot_of follows the table: position 6 is slot 2 of logical block 1.
  EXPECT_EQ(p.slot_of(a, 6), a.blocks[1] * 4 + 2);
  // offset: [block][kv head][slot][head_dim] (2 kv heads of 8 here).
  EXPECT_EQ(p.offset(p.slot_of(a, 6), 1), ((a.blocks[1] * 2 + 1) * 4 + 2) * 8);

  ASSERT_TRUE(p.reserve(b, 28));
  EXPECT_EQ(p.free_blocks(), 0);
  EXPECT_DOUBLE_EQ(p.usage(), 1.0);
  // Out of blocks: reported, and the table is unchanged.
  EXPECT_FALSE(p.reserve(a, 13));
  EXPECT_EQ(a.n_blocks(), 3);
  std::set<int32_t> all(a.blocks.begin(), a.blocks.end());
  all.insert(b.blocks.begin(), b.blocks.end());
  EXPECT_EQ(all.size(), size_t{10});  // no block handed out twice

  p.release(b);
  EXPECT_TRUE(b.blocks.empty());
  EXPECT_EQ(p.free_blocks(), 7);
  ASSERT_TRUE(p.reserve(a, 13));
  EXPECT_EQ(a.n_blocks(), 4);
  p.release(a);
  EXPECT_EQ(p.free_blocks(), 10);
  EXPECT_EQ(p.usage(), 0.0);
}

TEST(KvPool, AllocationOrderIsDeterministic) {
  Cpu cpu;
  auto run = [&] {
    KvPool p(*cpu.backend, tiny_config(), 12, 4);
    BlockTable a, b, c;
    EXPECT_TRUE(p.reserve(a, 10));
    EXPECT_TRUE(p.reserve(b, 7));
    p.release(a);
    EXPECT_TRUE(p.reserve(c, 20));
    std::vector<int32_t> ids = b.blocks;
    ids.insert(ids.end(), c.blocks.begin(), c.blocks.end());
    return ids;
  };
  const auto first = run();
  EXPECT_EQ(first, run());
  EXPECT_EQ(first.front(), 3);  // a took 0..2, b starts at 3
}

TEST(KvPool, PrefixMatchSharesFullBlocksOnly) {
  Cpu cpu;
  KvPool p(*cpu.backend, tiny_config(), 16, 4);
  const auto tok = iota_tokens(11);
  BlockTable a;
  ASSERT_TRUE(p.reserve(a, 11));
  p.commit_full_blocks(a, tok, 6);  // one full block computed
  EXPECT_EQ(p.cached_blocks(), 1);
  EXPECT_EQ(a.n_hashed, 1);
  p.commit_full_blocks(a, tok, 11);  // the second one now; the partial third is not cached
  EXPECT_EQ(p.cached_blocks(), 2);
  p.commit_full_blocks(a, tok, 11);  // idempotent
  EXPECT_EQ(p.cached_blocks(), 2);

  BlockTable b;
  EXPECT_EQ(p.cached_prefix_length(0, tok), 8);
  EXPECT_EQ(p.match_prefix(b, tok), 8);
  ASSERT_EQ(b.n_blocks(), 2);
  EXPECT_EQ(b.blocks[0], a.blocks[0]);
  EXPECT_EQ(b.blocks[1], a.blocks[1]);
  EXPECT_EQ(p.ref_count(a.blocks[0]), 2);
  EXPECT_EQ(p.ref_count(a.blocks[2]), 1);
  // b continues on its own block.
  ASSERT_TRUE(p.reserve(b, 9));
  EXPECT_NE(b.blocks[2], a.blocks[2]);

  // A prefix that differs inside block 1 matches block 0 only; one shorter than a block matches nothing.
  auto other = tok;
  other[6] = 7;
  EXPECT_EQ(p.cached_prefix_length(0, other), 4);
  EXPECT_EQ(p.cached_prefix_length(0, std::span<const int32_t>(tok).first(3)), 0);
  EXPECT_EQ(p.cached_prefix_length(0, std::span<const int32_t>(tok).first(7)), 4);
  // The same block content after a different first block is a different key (hash chain).
  auto shifted = tok;
  shifted[0] = 1;
  EXPECT_EQ(p.cached_prefix_length(0, shifted), 0);
}

TEST(KvPool, AdaptersNeverShareBlocks) {
  Cpu cpu;
  KvPool p(*cpu.backend, tiny_config(), 16, 4);
  const auto tok = iota_tokens(9);
  BlockTable base;
  ASSERT_TRUE(p.reserve(base, 9));
  p.commit_full_blocks(base, tok, 9);
  BlockTable lora;
  lora.adapter_id = 3;
  EXPECT_EQ(p.match_prefix(lora, tok), 0);
  ASSERT_TRUE(p.reserve(lora, 9));
  p.commit_full_blocks(lora, tok, 9);
  EXPECT_EQ(p.cached_blocks(), 4);
  EXPECT_EQ(p.cached_prefix_length(3, tok), 8);
  EXPECT_EQ(p.cached_prefix_length(4, tok), 0);
  BlockTable again;
  again.adapter_id = 3;
  EXPECT_EQ(p.match_prefix(again, tok), 8);
  EXPECT_EQ(again.blocks[0], lora.blocks[0]);
  EXPECT_EQ(again.blocks[1], lora.blocks[1]);
  EXPECT_NE(again.blocks[0], base.blocks[0]);
}

TEST(KvPool, ReleasedCachedBlocksStayUntilEvictedTailFirst) {
  Cpu cpu;
  KvPool p(*cpu.backend, tiny_config(), 6, 4);
  const auto tok = iota_tokens(12);
  BlockTable a;
  ASSERT_TRUE(p.reserve(a, 12));
  p.commit_full_blocks(a, tok, 12);
  const std::vector<int32_t> ablocks = a.blocks;
  p.release(a);
  EXPECT_EQ(p.usage(), 0.0);
  EXPECT_EQ(p.free_blocks(), 6);  // 3 never used + 3 evictable
  EXPECT_EQ(p.cached_blocks(), 3);

  // Never-used blocks go first: the cache survives a 3-block sequence.
  BlockTable b;
  ASSERT_TRUE(p.reserve(b, 12));
  EXPECT_EQ(p.cached_prefix_length(0, tok), 12);
  // The next block evicts a's last block (released first), not its first.
  BlockTable c;
  ASSERT_TRUE(p.reserve(c, 1));
  EXPECT_EQ(c.blocks[0], ablocks[2]);
  EXPECT_EQ(p.cached_prefix_length(0, tok), 8);
  EXPECT_EQ(p.cached_blocks(), 2);

  // Matching revives evictable blocks (taking them off the LRU list).
  BlockTable d;
  EXPECT_EQ(p.match_prefix(d, tok), 8);
  EXPECT_EQ(p.free_blocks(), 0);
  EXPECT_DOUBLE_EQ(p.usage(), 1.0);
  BlockTable e;
  EXPECT_FALSE(p.reserve(e, 1));
  p.release(d);
  EXPECT_EQ(p.free_blocks(), 2);
  p.clear_cache();
  EXPECT_EQ(p.cached_blocks(), 0);
  EXPECT_EQ(p.free_blocks(), 2);
  EXPECT_EQ(p.cached_prefix_length(0, tok), 0);
}

TEST(KvPool, DuplicateContentStaysPrivate) {
  Cpu cpu;
  KvPool p(*cpu.backend, tiny_config(), 8, 4);
  const auto tok = iota_tokens(8);
  BlockTable a, b;  // the same prompt prefilled side by side
  ASSERT_TRUE(p.reserve(a, 8));
  ASSERT_TRUE(p.reserve(b, 8));
  p.commit_full_blocks(a, tok, 8);
  p.commit_full_blocks(b, tok, 8);
  EXPECT_EQ(p.cached_blocks(), 2);
  EXPECT_EQ(b.n_hashed, 2);
  p.release(b);  // b's private copies are plain free blocks again
  EXPECT_EQ(p.free_blocks(), 6);
  BlockTable c;
  EXPECT_EQ(p.match_prefix(c, tok), 8);
  EXPECT_EQ(c.blocks, a.blocks);
}

// Random sequences over a 3-letter vocabulary (lots of shared prefixes) in a
// small pool. Each "computed" position gets a fingerprint of (adapter, tokens
// up to it) written into its K row; every matched prefix must show the
// fingerprints its own tokens imply, and the accounting must always add up.
TEST(KvPool, RandomStressKeepsCachedDataConsistent) {
  Cpu cpu;
  const ModelConfig cfg = tiny_config(1, 1, 8);
  for (int64_t bs : {1, 3, 4}) {
    KvPool p(*cpu.backend, cfg, 23, bs);
    std::mt19937 rng(static_cast<uint32_t>(77 + bs));
    struct Seq {
      BlockTable table;
      std::vector<int32_t> tokens;
      int64_t computed = 0;
    };
    std::vector<Seq> live;
    auto fingerprint = [](int64_t adapter, const std::vector<int32_t>& t, int64_t upto) {
      uint64_t h = 1469598103934665603ull ^ static_cast<uint64_t>(adapter);
      for (int64_t i = 0; i <= upto; ++i)
        h = (h ^ static_cast<uint64_t>(t[static_cast<size_t>(i)] + 1)) * 1099511628211ull;
      return static_cast<float>(h % 1000003);
    };
    int64_t hits = 0;
    for (int step = 0; step < 3000; ++step) {
      const int op = static_cast<int>(rng() % 10);
      if (op < 3 || live.empty()) {  // new sequence
        Seq s;
        s.table.adapter_id = static_cast<int64_t>(rng() % 3);
        const auto len = static_cast<int64_t>(1 + rng() % 14);
        for (int64_t i = 0; i < len; ++i) s.tokens.push_back(static_cast<int32_t>(rng() % 3));
        const int64_t m =
            p.match_prefix(s.table, std::span<const int32_t>(s.tokens).first(s.tokens.size() - 1));
        ASSERT_EQ(m % bs, 0);
        ASSERT_EQ(m, s.table.n_blocks() * bs);
        for (int64_t i = 0; i < m; ++i)
          ASSERT_EQ(static_cast<float*>(p.keys(0))[p.offset(p.slot_of(s.table, i), 0)],
                    fingerprint(s.table.adapter_id, s.tokens, i))
              << "block size " << bs << " step " << step << " position " << i;
        hits += m;
        s.computed = m;
        live.push_back(std::move(s));
      } else if (op < 8) {  // compute some positions (and maybe append a generated token)
        Seq& s = live[rng() % live.size()];
        if (s.computed == static_cast<int64_t>(s.tokens.size()))
          s.tokens.push_back(static_cast<int32_t>(rng() % 3));
        const int64_t upto = std::min<int64_t>(static_cast<int64_t>(s.tokens.size()),
                                               s.computed + 1 + static_cast<int64_t>(rng() % 5));
        if (!p.reserve(s.table, upto)) {  // preempt: drop the sequence
          p.release(s.table);
          live.erase(live.begin() + (&s - live.data()));
          continue;
        }
        for (int64_t i = s.computed; i < upto; ++i) {
          const int32_t blk = s.table.blocks[static_cast<size_t>(i / bs)];
          ASSERT_EQ(p.ref_count(blk), 1) << "writing into a shared block";
          static_cast<float*>(p.keys(0))[p.offset(p.slot_of(s.table, i), 0)] =
              fingerprint(s.table.adapter_id, s.tokens, i);
        }
        s.computed = upto;
        p.commit_full_blocks(s.table, s.tokens, s.computed);
      } else {  // finish
        const size_t i = rng() % live.size();
        p.release(live[i].table);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
      // Accounting: references equal table entries; in-use + free + evictable = all.
      std::map<int32_t, int32_t> refs;
      for (const Seq& s : live)
        for (int32_t b : s.table.blocks) ++refs[b];
      int64_t in_use = 0;
      for (int32_t b = 0; b < 23; ++b) {
        ASSERT_EQ(p.ref_count(b), refs.count(b) ? refs[b] : 0);
        in_use += p.ref_count(b) > 0;
      }
      ASSERT_EQ(in_use + p.free_blocks(), 23);
      ASSERT_DOUBLE_EQ(p.usage(), static_cast<double>(in_use) / 23);
    }
    EXPECT_GT(hits, 50) << "block size " << bs << ": the stress test should exercise prefix hits";
    std::printf("block size %ld: %ld positions from the prefix cache\n", static_cast<long>(bs),
                static_cast<long>(hits));
  }
}

}  // namespace
}  // namespace loom
