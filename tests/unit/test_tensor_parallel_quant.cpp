// Tensor parallel with quantized weights, SmolLM2-135M's shapes (hidden 576,
// MLP 1536, 3 ranks), random weights: what the split guarantees and what it
// cannot. A rank's row shard of q/k/v or gate/up (a row view) gives the whole
// model's outputs bit for bit (each output row is its own fixed sequence of
// float operations, kernels/cpu/matmul.h). The o and down column shards (whole
// blocks) give partial sums whose sum over the ranks differs from the whole
// product only by f32 rounding (another order of the same block terms), about
// 1e-7 relative. That is all the difference there is; but the next quantized
// product quantizes its activations (q8_0/q8_1/q8_K), and a 1-ulp change of
// an input that sits on a rounding boundary moves its 8-bit code by one step,
// so a quantized model's loss under dist.tp differs from one process's by the
// size of the activation rounding itself (about 1e-4 relative), as a 1-ulp
// nudge of one process's residual stream does; f32 weights stay within 1e-7.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/cpu/matmul.h"
#include "matmul_test_util.h"

namespace loom {
namespace {

using testing::random_floats;
using testing::random_weights;

constexpr int64_t kT = 64, kHidden = 576, kMlp = 1536, kRanks = 3;

Tensor matrix(const uint8_t* data, DType type, int64_t rows, int64_t cols) {
  Tensor w;
  w.data = const_cast<uint8_t*>(data);
  w.dtype = type;
  w.ndim = 2;
  w.shape[0] = rows;
  w.shape[1] = cols;
  return w;
}

// Row shards (q: 576 x 576 into 3 x 192 rows; the 256-blocks, whose rows must be
// a multiple of 256 wide, 576 x 1536 into 3 x 192 rows): bit-identical.
TEST(TensorParallelQuant, RowShardsAreBitIdentical) {
  ThreadPool pool(1);
  MatmulScratch scratch;
  for (DType type : {DType::q4_1, DType::q8_0, DType::q4_k, DType::q6_k}) {
    const int64_t K = dtype_block_size(type) == 256 ? kMlp : kHidden, N = kHidden, S = N / kRanks;
    const auto w = random_weights(type, N, K, 11);
    const auto x = random_floats(kT * K, 5);
    std::vector<float> whole(static_cast<size_t>(kT * N)), shard(static_cast<size_t>(kT * S));
    matmul(pool, PackedWeight::pack(matrix(w.data(), type, N, K)), x.data(), whole.data(), kT, scratch);
    for (int64_t r = 0; r < kRanks; ++r) {
      const Tensor rows = matrix(w.data() + static_cast<size_t>(r * S) * dtype_row_bytes(type, K), type, S, K);
      matmul(pool, PackedWeight::pack(rows), x.data(), shard.data(), kT, scratch);
      for (int64_t t = 0; t < kT; ++t)
        for (int64_t n = 0; n < S; ++n)
          ASSERT_EQ(whole[static_cast<size_t>(t * N + r * S + n)], shard[static_cast<size_t>(t * S + n)])
              << dtype_name(type) << " rank " << r << " token " << t << " row " << n;
    }
  }
}

// Column shards of whole blocks (o: 576 x 576 into 3 x 192 columns; down:
// 576 x 1536 into 3 x 512, the only SmolLM2 cut that fits 256-blocks): their
// partial sums add up to the whole product within f32 rounding.
TEST(TensorParallelQuant, ColumnShardsSumWithinFloatRounding) {
  ThreadPool pool(1);
  MatmulScratch scratch;
  for (DType type : {DType::q4_1, DType::q8_0, DType::q4_k, DType::q6_k}) {
    const int64_t K = dtype_block_size(type) == 256 ? kMlp : kHidden, N = kHidden, S = K / kRanks;
    ASSERT_EQ(S % dtype_block_size(type), 0);
    const auto w = random_weights(type, N, K, 12);
    const auto x = random_floats(kT * K, 6);
    std::vector<float> whole(static_cast<size_t>(kT * N)), sum(static_cast<size_t>(kT * N), 0.0f),
        part(static_cast<size_t>(kT * N));
    matmul(pool, PackedWeight::pack(matrix(w.data(), type, N, K)), x.data(), whole.data(), kT, scratch);
    const size_t full_row = dtype_row_bytes(type, K), shard_row = dtype_row_bytes(type, S);
    for (int64_t r = 0; r < kRanks; ++r) {  // as shard_weights_for_tensor_parallel copies them
      std::vector<uint8_t> cols(static_cast<size_t>(N) * shard_row);
      for (int64_t n = 0; n < N; ++n)
        std::memcpy(cols.data() + n * shard_row, w.data() + n * full_row + dtype_row_bytes(type, r * S), shard_row);
      matmul(pool, PackedWeight::pack(matrix(cols.data(), type, N, S)), x.data() + r * S, K, part.data(), N, kT,
             scratch);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    }
    float peak = 0, err = 0;
    for (size_t i = 0; i < sum.size(); ++i) {
      peak = std::max(peak, std::fabs(whole[i]));
      err = std::max(err, std::fabs(whole[i] - sum[i]));
    }
    EXPECT_LE(err, 1e-6f * peak) << dtype_name(type);
  }
}

}  // namespace
}  // namespace loom
