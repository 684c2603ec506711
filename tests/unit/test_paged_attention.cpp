// Paged attention (kernels/cpu/paged_attention.h): the AVX2 and AVX-512 kernels
// against the double reference and against plain attention over the gathered
// sequence, with random block tables, NaN in every slot that must not be read,
// and batch / thread-count / block-placement invariance (bit-exact); on
// AVX-512, rows of one segment bit-identical to the contiguous cache's attention.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <vector>

#include "core/half.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/paged_attention.h"
#include "kernels/ref/ops_ref.h"
#include "kernels/ref/paged_attention_ref.h"

namespace loom {
namespace {

struct Store {
  AttentionShape s;
  int64_t block_size = 0, n_blocks = 0;
  DType dtype = DType::f32;
  std::vector<float> k, v;                   // the values (exact halves when dtype is f16)
  std::vector<uint16_t> k16, v16;            // their f16 storage
  std::vector<std::vector<int32_t>> tables;  // per sequence
  std::vector<int64_t> lens;                 // positions written per sequence

  void encode() {
    if (dtype != DType::f16) return;
    k16.resize(k.size());
    v16.resize(v.size());
    for (size_t i = 0; i < k.size(); ++i) {
      k16[i] = fp32_to_fp16(k[i]);
      v16[i] = fp32_to_fp16(v[i]);
    }
  }
  PagedKv view() const {
    if (dtype == DType::f16) return {k16.data(), v16.data(), block_size, dtype};
    return {k.data(), v.data(), block_size, dtype};
  }
};

// Where kv head g of position p of a sequence with block table t starts.
int64_t at(const Store& st, const int32_t* t, int64_t p, int64_t g) {
  return ((t[p / st.block_size] * st.s.n_kv_heads + g) * st.block_size + p % st.block_size) * st.s.head_dim;
}

// Sequences of the given lengths in randomly chosen, shuffled blocks; every
// slot not holding a position of a sequence is NaN.
Store make_store(const AttentionShape& s, int64_t block_size, DType dtype, const std::vector<int64_t>& lens,
                 std::mt19937& rng) {
  Store st;
  st.s = s;
  st.dtype = dtype;
  st.block_size = block_size;
  st.lens = lens;
  int64_t need = 0;
  for (int64_t n : lens) need += (n + block_size - 1) / block_size;
  st.n_blocks = need + 5;  // some blocks stay unused
  std::vector<int32_t> ids(static_cast<size_t>(st.n_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  st.k.assign(static_cast<size_t>(st.n_blocks * block_size * s.n_kv_heads * s.head_dim), nan);
  st.v = st.k;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto draw = [&] { return dtype == DType::f16 ? fp16_to_fp32(fp32_to_fp16(nd(rng))) : nd(rng); };
  size_t next = 0;
  for (int64_t n : lens) {
    std::vector<int32_t> t;
    for (int64_t b = 0; b < (n + block_size - 1) / block_size; ++b) t.push_back(ids[next++]);
    for (int64_t p = 0; p < n; ++p)
      for (int64_t g = 0; g < s.n_kv_heads; ++g)
        for (int64_t i = 0; i < s.head_dim; ++i) {
          st.k[static_cast<size_t>(at(st, t.data(), p, g) + i)] = draw();
          st.v[static_cast<size_t>(at(st, t.data(), p, g) + i)] = draw();
        }
    st.tables.push_back(std::move(t));
  }
  st.encode();
  return st;
}

struct Rows {
  std::vector<int32_t> pos;
  std::vector<const int32_t*> tables;
  std::vector<int64_t> seq;
  std::vector<float> q;
};

// T query rows at random (sequence, position) pairs, last positions included.
Rows make_rows(const Store& st, int64_t T, std::mt19937& rng) {
  Rows r;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    const auto s = static_cast<size_t>(rng() % st.lens.size());
    const int64_t n = st.lens[s];
    const auto p =
        static_cast<int32_t>(t % 3 == 0 ? n - 1 : static_cast<int64_t>(rng() % static_cast<uint32_t>(n)));
    r.pos.push_back(p);
    r.tables.push_back(st.tables[s].data());
    r.seq.push_back(static_cast<int64_t>(s));
  }
  r.q.resize(static_cast<size_t>(T * st.s.n_heads * st.s.head_dim));
  // Larger queries make sharper softmaxes (max subtraction matters).
  for (auto& x : r.q) x = 2.0f * nd(rng);
  return r;
}

// The ISAs this CPU runs: each test runs every one of them.
std::vector<AttnIsa> isas() {
  std::vector<AttnIsa> out = {AttnIsa::avx2};
  if (attention_isa_supported(AttnIsa::avx512)) out.push_back(AttnIsa::avx512);
  return out;
}

const char* isa_name(AttnIsa isa) { return isa == AttnIsa::avx512 ? "avx512" : "avx2"; }

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return num / den;
}

struct Case {
  int64_t n_kv_heads, group, head_dim, block_size;
  DType dtype = DType::f32;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "kv heads " << c.n_kv_heads << ", group " << c.group << ", head_dim " << c.head_dim
      << ", block size " << c.block_size << ", " << dtype_name(c.dtype);
}

class PagedAttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(PagedAttentionTest, MatchesReferenceAndGatheredAttention) {
  const Case c = GetParam();
  const AttentionShape s{c.n_kv_heads * c.group, c.n_kv_heads, c.head_dim, c.n_kv_heads * c.head_dim};
  std::mt19937 rng(static_cast<uint32_t>(1000 + c.head_dim * 7 + c.group * 3 + c.block_size));
  const std::vector<int64_t> lens = {1, 17, 50, 33, 5, 129};
  const Store st = make_store(s, c.block_size, c.dtype, lens, rng);
  const int64_t T = 23;
  const Rows r = make_rows(st, T, rng);
  const size_t n_out = r.q.size();

  ThreadPool pool(3);
  std::vector<float> want(n_out);
  ref::paged_attention(s, st.view(), r.q.data(), want.data(), T, r.pos.data(), r.tables.data());
  // The default segment (every row in one), and segments of 32 and 48 positions
  // (rows of up to 5 merged segments).
  for (const AttnIsa isa : isas())
    for (const int64_t segment : {kPagedSegment, int64_t{32}, int64_t{48}}) {
      std::vector<float> out(n_out, std::numeric_limits<float>::quiet_NaN());
      paged_attention(pool, s, st.view(), r.q.data(), out.data(), T, r.pos.data(), r.tables.data(), segment,
                      isa);
      for (float x : out)
        ASSERT_TRUE(std::isfinite(x))
            << "read a NaN slot (segment " << segment << ", " << isa_name(isa) << ")";
      EXPECT_LT(max_rel_diff(out, want), 2e-6) << "segment " << segment << ", " << isa_name(isa);
    }

  // The reference against plain attention over each row's sequence gathered into contiguous rows.
  const int64_t width = s.n_heads * s.head_dim;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = r.pos[static_cast<size_t>(t)] + 1;
    std::vector<float> k(static_cast<size_t>(n * s.kv_stride)), v(k.size());
    for (int64_t p = 0; p < n; ++p)
      for (int64_t g = 0; g < s.n_kv_heads; ++g) {
        const auto from = static_cast<size_t>(at(st, r.tables[static_cast<size_t>(t)], p, g));
        const auto to = static_cast<size_t>(p * s.kv_stride + g * s.head_dim);
        std::memcpy(&k[to], &st.k[from], static_cast<size_t>(s.head_dim) * sizeof(float));
        std::memcpy(&v[to], &st.v[from], static_cast<size_t>(s.head_dim) * sizeof(float));
      }
    std::vector<float> o(static_cast<size_t>(width));
    const int32_t p = r.pos[static_cast<size_t>(t)];
    ref::attention(s, r.q.data() + t * width, k.data(), v.data(), o.data(), 1, &p, nullptr);
    for (int64_t i = 0; i < width; ++i)
      ASSERT_NEAR(o[static_cast<size_t>(i)], want[static_cast<size_t>(t * width + i)], 1e-6) << "row " << t;
  }
}

// The batch, a row at a time, one thread, and the same data in other physical
// blocks all give the same bits.
void check_invariance(const Case& c, int64_t segment, AttnIsa isa) {
  SCOPED_TRACE(isa_name(isa));
  const AttentionShape s{c.n_kv_heads * c.group, c.n_kv_heads, c.head_dim, c.n_kv_heads * c.head_dim};
  std::mt19937 rng(static_cast<uint32_t>(2000 + c.head_dim + c.group + c.block_size));
  const Store st = make_store(s, c.block_size, c.dtype, {40, 9, 77, 2}, rng);
  const int64_t T = 14, width = s.n_heads * s.head_dim;
  const Rows r = make_rows(st, T, rng);

  ThreadPool pool4(4), pool1(1);
  std::vector<float> batch(r.q.size()), single(r.q.size()), serial(r.q.size());
  paged_attention(pool4, s, st.view(), r.q.data(), batch.data(), T, r.pos.data(), r.tables.data(), segment,
                  isa);
  paged_attention(pool1, s, st.view(), r.q.data(), serial.data(), T, r.pos.data(), r.tables.data(), segment,
                  isa);
  for (int64_t t = 0; t < T; ++t)
    paged_attention(pool4, s, st.view(), r.q.data() + t * width, single.data() + t * width, 1,
                    &r.pos[static_cast<size_t>(t)], &r.tables[static_cast<size_t>(t)], segment, isa);
  EXPECT_EQ(0, std::memcmp(batch.data(), single.data(), batch.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(batch.data(), serial.data(), batch.size() * sizeof(float)));

  // The same data in other physical blocks (reversed ids) gives the same bits.
  Store moved = st;
  std::fill(moved.k.begin(), moved.k.end(), std::numeric_limits<float>::quiet_NaN());
  std::fill(moved.v.begin(), moved.v.end(), std::numeric_limits<float>::quiet_NaN());
  const int64_t blk = c.block_size * s.n_kv_heads * s.head_dim;
  for (auto& tb : moved.tables)
    for (int32_t& id : tb) {
      const auto to = static_cast<int32_t>(st.n_blocks - 1 - id);
      std::copy_n(st.k.begin() + id * blk, blk, moved.k.begin() + to * blk);
      std::copy_n(st.v.begin() + id * blk, blk, moved.v.begin() + to * blk);
      id = to;
    }
  moved.encode();
  std::vector<const int32_t*> moved_tables;
  for (int64_t seq : r.seq) moved_tables.push_back(moved.tables[static_cast<size_t>(seq)].data());
  std::vector<float> relocated(r.q.size());
  paged_attention(pool4, s, moved.view(), r.q.data(), relocated.data(), T, r.pos.data(), moved_tables.data(),
                  segment, isa);
  EXPECT_EQ(0, std::memcmp(batch.data(), relocated.data(), batch.size() * sizeof(float)));
}

TEST_P(PagedAttentionTest, BitIdenticalAcrossBatchThreadsAndPlacement) {
  for (const AttnIsa isa : isas()) check_invariance(GetParam(), kPagedSegment, isa);
}

// Rows of up to 3 segments of 32 positions (lengths 40 and 77), merged by whichever thread finishes last.
TEST_P(PagedAttentionTest, SplitRowsBitIdenticalAcrossBatchThreadsAndPlacement) {
  for (const AttnIsa isa : isas()) check_invariance(GetParam(), 32, isa);
}

// A prefill chunk: consecutive positions of one sequence (runs of rows that
// share each tile, more than one run of them, split rows among them) give each
// row the bits it gets alone, f32 and f16.
TEST(PagedAttention, ChunkRowsShareTilesBitIdenticalToEachRowAlone) {
  for (const DType dtype : {DType::f32, DType::f16}) {
    const AttentionShape s{8, 2, 64, 2 * 64};
    std::mt19937 rng(91);
    const Store st = make_store(s, 16, dtype, {150}, rng);
    const int64_t T = 70, width = s.n_heads * s.head_dim;  // positions 80..149
    std::vector<int32_t> pos(static_cast<size_t>(T));
    std::vector<const int32_t*> tables(static_cast<size_t>(T), st.tables[0].data());
    for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = static_cast<int32_t>(80 + t);
    std::vector<float> q(static_cast<size_t>(T * width));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& x : q) x = 2.0f * nd(rng);
    ThreadPool pool(3);
    for (const AttnIsa isa : isas())
      for (const int64_t segment : {kPagedSegment, int64_t{48}}) {
        std::vector<float> chunk(q.size()), alone(q.size()), want(q.size());
        paged_attention(pool, s, st.view(), q.data(), chunk.data(), T, pos.data(), tables.data(), segment,
                        isa);
        for (int64_t t = 0; t < T; ++t)
          paged_attention(pool, s, st.view(), q.data() + t * width, alone.data() + t * width, 1,
                          &pos[static_cast<size_t>(t)], &tables[static_cast<size_t>(t)], segment, isa);
        EXPECT_EQ(0, std::memcmp(chunk.data(), alone.data(), chunk.size() * sizeof(float)))
            << dtype_name(dtype) << ", segment " << segment << ", " << isa_name(isa);
        ref::paged_attention(s, st.view(), q.data(), want.data(), T, pos.data(), tables.data());
        EXPECT_LT(max_rel_diff(chunk, want), 2e-6)
            << dtype_name(dtype) << ", segment " << segment << ", " << isa_name(isa);
      }
  }
}

// The segment split on a real length: 2,000 positions (4 segments of 512, the
// last partial) against the double reference, as one row and beside short rows.
TEST(PagedAttention, LongRowInDefaultSegmentsMatchesReference) {
  for (const DType dtype : {DType::f32, DType::f16}) {
    const AttentionShape s{9, 3, 64, 3 * 64};  // SmolLM2's heads
    std::mt19937 rng(77);
    const Store st = make_store(s, 16, dtype, {2000, 30}, rng);
    const std::vector<int32_t> pos = {1999, 29, 1024, 511, 512};
    const std::vector<const int32_t*> tables = {st.tables[0].data(), st.tables[1].data(), st.tables[0].data(),
                                                st.tables[0].data(), st.tables[0].data()};
    const auto T = static_cast<int64_t>(pos.size());
    std::vector<float> q(static_cast<size_t>(T * s.n_heads * s.head_dim));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& x : q) x = 2.0f * nd(rng);
    ThreadPool pool(3);
    std::vector<float> want(q.size());
    ref::paged_attention(s, st.view(), q.data(), want.data(), T, pos.data(), tables.data());
    for (const AttnIsa isa : isas()) {
      std::vector<float> out(q.size());
      paged_attention(pool, s, st.view(), q.data(), out.data(), T, pos.data(), tables.data(), kPagedSegment,
                      isa);
      EXPECT_LT(max_rel_diff(out, want), 2e-6) << dtype_name(dtype) << ", " << isa_name(isa);
    }
  }
}

// One sequence of a store gathered into a contiguous cache of the same elements.
struct Contiguous {
  std::vector<float> k, v;
  std::vector<uint16_t> k16, v16;
  DType dtype;
  Contiguous(const Store& st, size_t seq) : dtype(st.dtype) {
    const AttentionShape& s = st.s;
    const int64_t len = st.lens[seq];
    const int32_t* table = st.tables[seq].data();
    k.resize(static_cast<size_t>(len * s.kv_stride));
    v.resize(k.size());
    for (int64_t p = 0; p < len; ++p)
      for (int64_t g = 0; g < s.n_kv_heads; ++g) {
        const auto from = static_cast<size_t>(at(st, table, p, g));
        const auto to = static_cast<size_t>(p * s.kv_stride + g * s.head_dim);
        std::copy_n(st.k.begin() + from, s.head_dim, k.begin() + to);
        std::copy_n(st.v.begin() + from, s.head_dim, v.begin() + to);
      }
    for (size_t i = 0; i < k.size(); ++i) {
      k16.push_back(fp32_to_fp16(k[i]));
      v16.push_back(fp32_to_fp16(v[i]));
    }
  }
  KvRows rows() const {
    return dtype == DType::f16 ? KvRows{k16.data(), v16.data(), dtype} : KvRows{k.data(), v.data(), dtype};
  }
};

// Rows at `pos` of sequence 0, paged on `isa` against the contiguous cache's attention: the same bits.
void expect_contiguous_bits(const Store& st, const Contiguous& c, const std::vector<int32_t>& pos,
                            AttnIsa isa, std::mt19937& rng) {
  const AttentionShape& s = st.s;
  const auto T = static_cast<int64_t>(pos.size());
  const std::vector<const int32_t*> tables(pos.size(), st.tables[0].data());
  std::vector<float> q(static_cast<size_t>(T * s.n_heads * s.head_dim)), paged(q.size()),
      contiguous(q.size());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& x : q) x = 2.0f * nd(rng);
  ThreadPool pool(2);
  paged_attention(pool, s, st.view(), q.data(), paged.data(), T, pos.data(), tables.data(), kPagedSegment,
                  isa);
  attention(pool, s, q.data(), c.rows(), contiguous.data(), T, pos.data(), nullptr);
  EXPECT_EQ(0, std::memcmp(paged.data(), contiguous.data(), paged.size() * sizeof(float)))
      << T << " rows from position " << pos[0];
}

// Where head_dim is a multiple of 16 a row of one segment gets the contiguous
// cache's attention bits (ops.h, which every path and ISA computes as
// attend_row does) on the same keys and values, on both ISAs: decode rows one
// at a time (as generate runs them), a prefill chunk of 40 rows (keys read
// transposed), f32 and f16, head_dim 64 and 128.
TEST(PagedAttention, OneSegmentRowsEqualContiguousAttentionBitForBit) {
  for (const DType dtype : {DType::f32, DType::f16})
    for (const int64_t head_dim : {int64_t{64}, int64_t{128}}) {
      const AttentionShape s{12, 3, head_dim, 3 * head_dim};
      std::mt19937 rng(static_cast<uint32_t>(5 + head_dim));
      const Store st = make_store(s, 16, dtype, {300}, rng);
      const Contiguous c(st, 0);
      std::vector<int32_t> chunk(40);
      std::iota(chunk.begin(), chunk.end(), 260);
      for (const AttnIsa isa : isas()) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + ", head_dim " + std::to_string(head_dim) + ", " +
                     isa_name(isa));
        for (const int32_t p : {0, 1, 16, 37, 299}) expect_contiguous_bits(st, c, {p}, isa, rng);
        expect_contiguous_bits(st, c, chunk, isa, rng);
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PagedAttentionTest,
                         ::testing::Values(Case{2, 1, 64, 16}, Case{3, 3, 64, 16}, Case{2, 4, 80, 16},
                                           Case{1, 3, 80, 5}, Case{2, 4, 64, 7}, Case{2, 2, 16, 16},
                                           Case{1, 1, 20, 3}, Case{1, 8, 128, 32}, Case{4, 3, 36, 16},
                                           Case{3, 3, 64, 16, DType::f16}, Case{2, 4, 80, 7, DType::f16},
                                           Case{1, 1, 20, 3, DType::f16},
                                           // past kMaxConvertDim: f16 rows read without widening
                                           Case{1, 2, 264, 16, DType::f16}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           const Case& c = i.param;
                           return "kv" + std::to_string(c.n_kv_heads) + "_g" + std::to_string(c.group) +
                                  "_d" + std::to_string(c.head_dim) + "_bs" + std::to_string(c.block_size) +
                                  "_" + dtype_name(c.dtype);
                         });

}  // namespace
}  // namespace loom
