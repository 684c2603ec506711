// The AVX2 dequantization of 4-bit spans (kernels/cpu/int4_dequant.h) gives
// the bits of unpack_int4_rows for any span: odd and even starts and lengths,
// spans inside one group and across groups and rows, groups of 6 to 176 (the
// fast paths of groups 8, 16 and multiples of 32 from 32-aligned starts, and
// the general one).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kernels/cpu/int4_dequant.h"
#include "kernels/int_quant.h"
#include "ops_test_util.h"

namespace loom {
namespace {

TEST(Int4Dequant, SpansEqualUnpackInt4RowsBitForBit) {
  struct Shape {
    int64_t rows, cols, group;
  };
  for (const Shape sh : {Shape{5, 576, 96}, Shape{4, 176, 176}, Shape{7, 100, 100}, Shape{9, 16, 16},
                         Shape{12, 8, 8}, Shape{6, 64, 32}, Shape{4, 192, 64}, Shape{6, 12, 6}, Shape{3, 256, 128}}) {
    const auto w = test_util::random_vec(static_cast<size_t>(sh.rows * sh.cols), 11, 0.3f);
    const PackedInt4 p = pack_int4_rows(w.data(), sh.rows, sh.cols, sh.group);
    std::vector<float> want(w.size());
    unpack_int4_rows(p.codes.data(), p.scales.data(), sh.rows, sh.cols, sh.group, want.data());
    const Int4Rows m{p.codes.data(), p.scales.data(), p.group};
    const int64_t n_all = sh.rows * sh.cols;
    for (int64_t e : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{32}, int64_t{64}, sh.group - 1, sh.group,
                      sh.cols + 3, 2 * sh.cols})
      for (int64_t n : {int64_t{1}, int64_t{8}, int64_t{15}, int64_t{16}, int64_t{33}, int64_t{64}, int64_t{100},
                        sh.group, 2 * sh.cols + 5}) {
        if (e + n > n_all) continue;
        std::vector<float> got(static_cast<size_t>(n) + 1, -1.0f);
        int4::dequant_span(m, e, n, got.data());
        EXPECT_EQ(std::memcmp(got.data(), want.data() + e, static_cast<size_t>(n) * sizeof(float)), 0)
            << sh.cols << "/" << sh.group << " at " << e << " n " << n;
        EXPECT_EQ(got[static_cast<size_t>(n)], -1.0f) << "wrote past the span";
      }
  }
}

}  // namespace
}  // namespace loom
