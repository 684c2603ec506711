// Gathering full fine-tuning's tensor-parallel shards into the whole model (full_tp.h).
#include "train/full_tp.h"

#include <cstring>

#include "core/error.h"

namespace loom {

namespace {

// Every rank's n floats at `mine`, in rank order, on rank 0 (empty elsewhere).
std::vector<float> gather_floats(Communicator& comm, const float* mine, size_t n) {
  const auto N = static_cast<size_t>(comm.size());
  std::vector<float> all(comm.rank() == 0 ? N * n : 0);
  comm.gatherv(mine, all.data(), std::vector<size_t>(N, n * sizeof(float)), 0);
  return all;
}

// A shard [rows, cols] cut by rows (the shards in rank order are the whole,
// [N rows, cols]) or by columns (rank k's columns [k cols, (k+1) cols) of every
// row of the whole [rows, N cols]); `t` then points at the whole in `store`.
void gather_matrix(Communicator& comm, Tensor& t, bool by_columns, std::vector<std::vector<float>>& store) {
  LOOM_ASSERT(t.dtype == DType::f32 && t.ndim == 2);  // FullParams' arena
  const int64_t N = comm.size(), R = t.rows(), C = t.cols();
  std::vector<float> all = gather_floats(comm, t.as<float>(), static_cast<size_t>(R * C));
  if (comm.rank() != 0) return;
  if (by_columns) {
    std::vector<float> whole(all.size());
    for (int64_t k = 0; k < N; ++k)
      for (int64_t r = 0; r < R; ++r)
        std::memcpy(whole.data() + (r * N + k) * C, all.data() + (k * R + r) * C, static_cast<size_t>(C) * sizeof(float));
    all.swap(whole);
  }
  store.push_back(std::move(all));
  t.data = store.back().data();
  t.shape[by_columns ? 1 : 0] *= N;
}

void gather_vector(Communicator& comm, const float*& v, size_t n, std::vector<std::vector<float>>& store) {
  std::vector<float> all = gather_floats(comm, v, n);
  if (comm.rank() != 0) return;
  store.push_back(std::move(all));
  v = store.back().data();
}

}  // namespace

std::vector<TensorParallelRun> full_tensor_parallel_runs(const FullParams& shard, int rank, int ranks) {
  LOOM_ASSERT(rank >= 0 && rank < ranks);
  const auto k = static_cast<size_t>(rank), N = static_cast<size_t>(ranks);
  std::vector<TensorParallelRun> runs;
  size_t at = 0;  // the tensor in the whole arena
  for (const FullParams::CutSpan& s : shard.cut_spans()) {
    switch (s.cut) {
      case FullParams::Cut::none:
        runs.push_back({s.offset, at, s.size, true});
        break;
      case FullParams::Cut::rows:  // the shards in rank order are the whole
        runs.push_back({s.offset, at + k * s.size, s.size, false});
        break;
      case FullParams::Cut::columns: {  // [rows, cols] of the whole [rows, N cols]: its columns of each row
        const auto rows = static_cast<size_t>(s.rows), cols = s.size / rows;
        for (size_t r = 0; r < rows; ++r)
          runs.push_back({s.offset + r * cols, at + (r * N + k) * cols, cols, false});
        break;
      }
    }
    at += s.cut == FullParams::Cut::none ? s.size : s.size * N;
  }
  return runs;
}

size_t full_tensor_parallel_whole_size(const FullParams& shard, int ranks) {
  size_t n = 0;
  for (const FullParams::CutSpan& s : shard.cut_spans())
    n += s.cut == FullParams::Cut::none ? s.size : s.size * static_cast<size_t>(ranks);
  return n;
}

void gather_full_tensor_parallel(Communicator& comm, ModelWeights& w, std::vector<std::vector<float>>& store) {
  for (LayerWeights& L : w.layers) {
    const auto q_rows = static_cast<size_t>(L.wq.rows()), kv_rows = static_cast<size_t>(L.wk.rows());
    gather_matrix(comm, L.wq, false, store);
    gather_matrix(comm, L.wk, false, store);
    gather_matrix(comm, L.wv, false, store);
    gather_matrix(comm, L.wo, true, store);
    gather_matrix(comm, L.w_gate, false, store);
    gather_matrix(comm, L.w_up, false, store);
    gather_matrix(comm, L.w_down, true, store);
    if (L.bq != nullptr) {
      gather_vector(comm, L.bq, q_rows, store);
      gather_vector(comm, L.bk, kv_rows, store);
      gather_vector(comm, L.bv, kv_rows, store);
    }
  }
}

}  // namespace loom
