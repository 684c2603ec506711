// Cutting a loaded model into one tensor-parallel rank's shard.
#include "model/tensor_parallel.h"

#include <cstring>

#include <fmt/format.h>

#include "core/error.h"
#include "kernels/cpu/dequant.h"

namespace loom {

namespace {

// Rows [lo, lo + n) of a row-major matrix, as a view.
Tensor row_slice(const Tensor& t, int64_t lo, int64_t n) {
  Tensor s = t;
  s.data = static_cast<uint8_t*>(t.data) + static_cast<size_t>(lo) * t.row_bytes();
  s.shape[static_cast<size_t>(s.ndim - 2)] = n;
  return s;
}

// Columns [lo, lo + n) of every row, copied into a buffer `w` owns.
Tensor column_slice(ModelWeights& w, const Tensor& t, int64_t lo, int64_t n) {
  const int64_t block = dtype_block_size(t.dtype);
  const bool whole_blocks = dtype_row_header_bytes(t.dtype) == 0 && lo % block == 0 && n % block == 0;
  const DType out = whole_blocks ? t.dtype : DType::f32;
  const size_t row_out = dtype_row_bytes(out, n);
  auto& buf = w.owned_bytes.emplace_back(static_cast<size_t>(t.rows()) * row_out);
  std::vector<float> row(static_cast<size_t>(t.cols()));
  for (int64_t r = 0; r < t.rows(); ++r) {
    const auto* src = static_cast<const uint8_t*>(t.row_ptr(r));
    uint8_t* dst = buf.data() + static_cast<size_t>(r) * row_out;
    if (whole_blocks) {
      std::memcpy(dst, src + dtype_row_bytes(t.dtype, lo), row_out);
    } else {
      dequantize_row(t.dtype, src, row.data(), t.cols());
      std::memcpy(dst, row.data() + lo, static_cast<size_t>(n) * sizeof(float));
    }
  }
  Tensor s = t;
  s.data = buf.data();
  s.dtype = out;
  s.shape[static_cast<size_t>(s.ndim - 1)] = n;
  return s;
}

}  // namespace

ModelConfig tensor_parallel_config(const ModelConfig& full, int ranks) {
  if (ranks < 1) fail(ErrorKind::invalid_input, "tensor parallel: {} ranks", ranks);
  if (full.n_heads % ranks != 0 || full.n_kv_heads % ranks != 0 || full.intermediate % ranks != 0)
    fail(ErrorKind::invalid_input, "tensor parallel over {} ranks needs the heads ({}), the kv heads ({}) and the MLP "
         "width ({}) to divide by {}", ranks, full.n_heads, full.n_kv_heads, full.intermediate, ranks);
  ModelConfig c = full;
  c.n_heads /= ranks;
  c.n_kv_heads /= ranks;
  c.intermediate /= ranks;
  return c;
}

void shard_weights_for_tensor_parallel(ModelWeights& w, const ModelConfig& full, int rank, int ranks) {
  const ModelConfig c = tensor_parallel_config(full, ranks);
  LOOM_ASSERT(rank >= 0 && rank < ranks);
  const int64_t Q = c.q_dim(), KV = c.kv_dim(), F = c.intermediate;
  for (LayerWeights& L : w.layers) {
    if (!L.held()) continue;  // another pipeline stage's layer
    L.wq = row_slice(L.wq, rank * Q, Q);
    L.wk = row_slice(L.wk, rank * KV, KV);
    L.wv = row_slice(L.wv, rank * KV, KV);
    if (L.bq != nullptr) {
      L.bq += rank * Q;
      L.bk += rank * KV;
      L.bv += rank * KV;
    }
    L.wo = column_slice(w, L.wo, rank * Q, Q);
    L.w_gate = row_slice(L.w_gate, rank * F, F);
    L.w_up = row_slice(L.w_up, rank * F, F);
    L.w_down = column_slice(w, L.w_down, rank * F, F);
  }
}

bool lora_target_row_parallel(LoraTarget t) { return t == LoraTarget::o || t == LoraTarget::down; }

void lora_pair_shard(LoraTarget t, const float* a, const float* b, int64_t r, int64_t in, int64_t out,
                     int rank, int ranks, float* a_out, float* b_out) {
  LOOM_ASSERT(rank >= 0 && rank < ranks && r > 0);
  const bool row_parallel = lora_target_row_parallel(t);
  LOOM_ASSERT(row_parallel ? in % ranks == 0 : out % ranks == 0);
  const int64_t in_s = row_parallel ? in / ranks : in, out_s = row_parallel ? out : out / ranks;
  for (int64_t i = 0; i < r; ++i)  // A: this rank's columns of every row (all of them when whole)
    std::memcpy(a_out + i * in_s, a + i * in + (row_parallel ? rank * in_s : 0),
                static_cast<size_t>(in_s) * sizeof(float));
  // B: this rank's rows, which are contiguous (all of them when whole)
  std::memcpy(b_out, b + (row_parallel ? 0 : rank * out_s * r),
              static_cast<size_t>(out_s * r) * sizeof(float));
}

}  // namespace loom
