// Tensor parallel (model/tensor_parallel.h, dist.tp): N ranks (threads over
// the in-process communicator), each with its shard of the tiny llama's heads
// and MLP channels, compute the loss and the LoRA gradients of one process
// with the whole model: loss within 1e-6 relative, every gathered gradient
// tensor within 1e-5 of its largest value (float sums in another order), also
// with LoRA dropout (the masks one process draws; a rank's columns of a mask
// bit for bit). Also the shard shapes, the sizes that do not divide, the
// gathered adapters at the start equal to a whole model's initialization, and
// the arena map (train/lora_tp.h) exact both ways; full fine-tuning's shards
// gathered into one process's gradients, and its arena map (train/full_tp.h)
// the loader's cut bit for bit, both ways.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/backend.h"
#include "model/tensor_parallel.h"
#include "thread_communicator.h"
#include "train/lora_params.h"
#include "train/lora_tp.h"
#include "train/train_config.h"
#include "train/train_step.h"
#include "train/trainable.h"
#include "train/tp_runs.h"

namespace loom {
namespace {

using test_util::run_ranks;
using test_util::ThreadCommunicator;

std::string tiny() { return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/model/tiny-llama.f32.gguf"; }

TrainConfig lora_config(int tp, double dropout = 0) {
  TrainConfig c;
  c.model = tiny();
  c.lora.r = 4;
  c.lora.alpha = 8;
  c.lora.dropout = dropout;
  c.lora.seed = 3;
  c.dist.tp = tp;
  return c;
}

// Two rows of 16 tokens of the tiny model's 320; row 1 packs two samples.
Batch make_batch() {
  std::mt19937 rng(7);
  Batch b;
  b.rows = 2;
  b.seq_len = 16;
  for (int64_t r = 0; r < b.rows; ++r)
    for (int32_t t = 0; t < b.seq_len; ++t) {
      const int32_t start = r == 1 && t >= 6 ? 6 : 0;
      b.tokens.push_back(static_cast<int32_t>(rng() % 320));
      const bool target = t + 1 < b.seq_len && t != 5;
      b.targets.push_back(target ? static_cast<int32_t>(rng() % 320) : kIgnoreLabel);
      b.positions.push_back(t - start);
      b.seq_start.push_back(start);
      b.target_tokens += target ? 1 : 0;
    }
  return b;
}

bool row_parallel(LoraTarget t) { return t == LoraTarget::o || t == LoraTarget::down; }

// The shard `rank` of `ranks` of a whole adapter arena (layout LoraModel(full)),
// in the layout LoraModel(shard config): q/k/v/gate/up B rows and o/down A
// columns of the rank, the rest whole.
std::vector<float> shard_arena(const std::vector<float>& whole, const ModelConfig& full, const LoraConfig& lc,
                               int rank, int ranks) {
  const LoraModel wl(full, lc), sl(tensor_parallel_config(full, ranks), lc);
  std::vector<float> out(static_cast<size_t>(sl.param_count()));
  const int64_t r = lc.r;
  for (int64_t l = 0; l < sl.n_layers(); ++l)
    for (LoraTarget t : kAllLoraTargets) {
      const LoraSlot &ws = wl.slot(l, t), &ss = sl.slot(l, t);
      if (!ss.active) continue;
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < ss.in; ++j)
          out[ss.a_offset + static_cast<size_t>(i * ss.in + j)] =
              whole[ws.a_offset + static_cast<size_t>(i * ws.in + (row_parallel(t) ? rank * ss.in : 0) + j)];
      for (int64_t o = 0; o < ss.out; ++o)
        for (int64_t i = 0; i < r; ++i)
          out[ss.b_offset + static_cast<size_t>(o * r + i)] =
              whole[ws.b_offset + static_cast<size_t>(((row_parallel(t) ? 0 : rank * ss.out) + o) * r + i)];
    }
  return out;
}

class CommSums final : public PartialSums {
 public:
  explicit CommSums(Communicator& c) : c_(c) {}
  void sum(float* x, int64_t n) override { c_.allreduce_sum(std::span<float>(x, static_cast<size_t>(n))); }

 private:
  Communicator& c_;
};

struct Reference {
  ModelConfig config;
  std::vector<float> params, grads;
  double loss = 0, eval_loss = 0;
};

// One process, the whole model, adapters set to `seeded` random values (B too,
// so that every gradient is non-zero); `step` selects the dropout masks.
Reference whole_model_step(const Batch& batch, double dropout = 0, uint64_t step = 0) {
  ThreadPool pool(1);
  auto backend = make_backend(kCpu, pool);
  TrainableModel m = load_trainable_model(lora_config(1, dropout), *backend, pool);
  Reference ref;
  ref.config = m.model->config();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.2f);
  for (float& p : m.params->params()) p = normal(rng);
  ref.params.assign(m.params->params().begin(), m.params->params().end());
  auto session = m.params->make_session(*m.model, *backend, BackwardMode::exact);
  m.params->zero_grads();
  const float scale = 1.0f / static_cast<float>(batch.target_tokens);
  ref.loss = session->forward_backward(batch, scale, step).loss_sum * scale;
  ref.grads.assign(m.params->grads().begin(), m.params->grads().end());
  ref.eval_loss = session->forward_loss(batch).loss_sum * scale;
  return ref;
}

// The whole arena's tensors (layout of LoraModel(full)) within tol of their largest |value|.
void expect_close_tensors(const std::vector<float>& got, const std::vector<float>& want, const ModelConfig& full,
                          const LoraConfig& lc, double tol) {
  const LoraModel wl(full, lc);
  const auto r = static_cast<size_t>(lc.r);
  ASSERT_EQ(got.size(), want.size());
  for (int64_t l = 0; l < wl.n_layers(); ++l)
    for (LoraTarget t : kAllLoraTargets) {
      const LoraSlot& s = wl.slot(l, t);
      if (!s.active) continue;
      for (const auto& [offset, n, what] : {std::tuple{s.a_offset, r * static_cast<size_t>(s.in), "A"},
                                           std::tuple{s.b_offset, static_cast<size_t>(s.out) * r, "B"}}) {
        double largest = 0, diff = 0;
        for (size_t i = offset; i < offset + n; ++i) {
          largest = std::max(largest, std::fabs(static_cast<double>(want[i])));
          diff = std::max(diff, std::fabs(static_cast<double>(got[i]) - want[i]));
        }
        ASSERT_GT(largest, 0.0) << "layer " << l << " " << lora_target_peft_name(t) << " " << what;
        EXPECT_LE(diff, tol * largest) << "layer " << l << " " << lora_target_peft_name(t) << " " << what;
      }
    }
}

TEST(TensorParallel, ShardShapesAndSizesThatDoNotDivide) {
  ThreadPool pool(1);
  auto backend = make_backend(kCpu, pool);
  TrainableModel m = load_trainable_model(lora_config(2), *backend, pool, nullptr, 1);
  EXPECT_EQ(m.model->config().n_heads, 2);
  EXPECT_EQ(m.model->config().n_kv_heads, 1);
  EXPECT_EQ(m.model->config().intermediate, 88);
  const LayerWeights& L = m.model->weights().layers[0];
  EXPECT_EQ(L.wq.rows(), 32);
  EXPECT_EQ(L.wk.rows(), 16);
  EXPECT_EQ(L.wo.cols(), 32);
  EXPECT_EQ(L.w_down.cols(), 88);
  EXPECT_EQ(L.w_gate.rows(), 88);
  try {
    load_trainable_model(lora_config(4), *backend, pool, nullptr, 0);  // 2 kv heads over 4 ranks
    ADD_FAILURE() << "dist.tp 4 accepted with 2 kv heads";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kv heads (2)"), std::string::npos) << e.what();
  }
  TrainConfig full = lora_config(2);
  full.method = TrainMethod::full;  // the arena takes the shard
  TrainableModel f = load_trainable_model(full, *backend, pool, nullptr, 1);
  EXPECT_EQ(f.model->config().n_heads, 2);
  EXPECT_EQ(f.model->weights().layers[0].w_down.cols(), 88);
  EXPECT_EQ(f.model->weights().layers[0].w_down.dtype, DType::f32);
}

// One rank's step with its shard of `ref`'s adapters in `m`: the loss (per
// target token) and the gradients, the whole adapters' partial sums summed
// (the Trainer's sum_replicated_grads). The session stays for more calls.
struct ShardStep {
  std::unique_ptr<CommSums> sums;
  std::unique_ptr<TrainSession> session;
  double loss = 0;
};
ShardStep shard_step(ThreadCommunicator& comm, TrainableModel& m, Backend& backend, const Reference& ref,
                     const LoraConfig& lc, const Batch& batch, uint64_t step = 0) {
  const int rank = comm.rank(), N = comm.size();
  const std::vector<float> mine = shard_arena(ref.params, ref.config, lc, rank, N);
  std::copy(mine.begin(), mine.end(), m.params->params().begin());
  ShardStep s;
  s.sums = std::make_unique<CommSums>(comm);
  s.session = m.params->make_session(*m.model, backend, BackwardMode::exact);
  s.session->set_tensor_parallel(s.sums.get(), rank, N);
  m.params->zero_grads();
  const float scale = 1.0f / static_cast<float>(batch.target_tokens);
  s.loss = s.session->forward_backward(batch, scale, step).loss_sum * scale;
  const std::span<float> g = m.params->grads();
  for (const auto& [o, n] : m.params->replicated_ranges()) comm.allreduce_sum(g.subspan(o, n));
  return s;
}

TEST(TensorParallel, TwoRanksEqualOneProcess) {
  const Batch batch = make_batch();
  const Reference ref = whole_model_step(batch);
  const int N = 2;
  const LoraConfig lc = lora_config(N).lora;
  std::vector<double> loss(N), eval_loss(N);
  std::vector<float> gathered_grads, gathered_init;
  run_ranks(N, [&](ThreadCommunicator& comm) {
    const int rank = comm.rank();
    ThreadPool pool(1);
    auto backend = make_backend(kCpu, pool);
    TrainableModel m = load_trainable_model(lora_config(N), *backend, pool, nullptr, rank);
    // The adapters at the start, gathered: a whole model's initialization.
    std::vector<float> init(m.params->params().begin(), m.params->params().end());
    const ShardStep s = shard_step(comm, m, *backend, ref, lc, batch);
    loss[static_cast<size_t>(rank)] = s.loss;
    const float scale = 1.0f / static_cast<float>(batch.target_tokens);
    eval_loss[static_cast<size_t>(rank)] = s.session->forward_loss(batch).loss_sum * scale;
    const std::span<float> g = m.params->grads();
    // Gather the gradients through the adapters' own gather: put them in the parameter arena.
    std::copy(g.begin(), g.end(), m.params->params().begin());
    m.params->gather_tensor_parallel(comm, ref.config);
    if (rank == 0) gathered_grads.assign(m.params->params().begin(), m.params->params().end());
    std::copy(init.begin(), init.end(), m.params->params().begin());
    TrainableModel again = load_trainable_model(lora_config(N), *backend, pool, nullptr, rank);
    again.params->gather_tensor_parallel(comm, ref.config);
    if (rank == 0) gathered_init.assign(again.params->params().begin(), again.params->params().end());
  });
  for (int r = 0; r < N; ++r) {
    EXPECT_NEAR(loss[static_cast<size_t>(r)], ref.loss, 1e-6 * ref.loss) << "rank " << r;
    EXPECT_NEAR(eval_loss[static_cast<size_t>(r)], ref.eval_loss, 1e-6 * ref.eval_loss) << "rank " << r;
  }
  expect_close_tensors(gathered_grads, ref.grads, ref.config, lc, 1e-5);
  // The initialization: gathered shards are exactly the whole model's LoRA init.
  LoraModel whole(ref.config, lc);
  ASSERT_EQ(gathered_init.size(), static_cast<size_t>(whole.param_count()));
  EXPECT_TRUE(std::equal(gathered_init.begin(), gathered_init.end(), whole.params()));
}

// Every weight of `w` as floats, by name (full fine-tuning's are f32 views of its arena).
std::vector<std::pair<std::string, std::vector<float>>> weight_tensors(const ModelWeights& w, int64_t H) {
  std::vector<std::pair<std::string, std::vector<float>>> out;
  auto matrix = [&](const std::string& name, const Tensor& t) {
    EXPECT_EQ(t.dtype, DType::f32) << name;
    out.push_back({name, std::vector<float>(t.as<float>(), t.as<float>() + t.numel())});
  };
  auto vec = [&](const std::string& name, const float* v) { out.push_back({name, std::vector<float>(v, v + H)}); };
  matrix("token_embd", w.token_embd);
  matrix("output", w.output);
  vec("output_norm", w.output_norm);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = "layer " + std::to_string(l) + " ";
    vec(p + "attn_norm", L.attn_norm);
    vec(p + "ffn_norm", L.ffn_norm);
    matrix(p + "wq", L.wq);
    matrix(p + "wk", L.wk);
    matrix(p + "wv", L.wv);
    matrix(p + "wo", L.wo);
    matrix(p + "w_gate", L.w_gate);
    matrix(p + "w_up", L.w_up);
    matrix(p + "w_down", L.w_down);
  }
  return out;
}

// Full fine-tuning: 2 ranks, each with its f32 shard of the weights, give one
// process's loss (1e-6) and, gathered whole, every weight's gradient within
// 1e-5 of its largest value; the uncut tensors' gradients come out alike on
// every rank without a sum. The gradients travel through the trainable's own
// gather (copied into the parameter arena the model's weights view).
TEST(TensorParallel, FullFineTuningTwoRanksEqualOneProcess) {
  const Batch batch = make_batch();
  const float scale = 1.0f / static_cast<float>(batch.target_tokens);
  auto grads_into_params = [](TrainableParams& p) { std::copy(p.grads().begin(), p.grads().end(), p.params().begin()); };
  TrainConfig c1 = lora_config(1);
  c1.method = TrainMethod::full;
  ThreadPool pool(1);
  auto backend = make_backend(kCpu, pool);
  TrainableModel one = load_trainable_model(c1, *backend, pool);
  auto s1 = one.params->make_session(*one.model, *backend, BackwardMode::exact);
  one.params->zero_grads();
  const double ref_loss = s1->forward_backward(batch, scale).loss_sum * scale;
  grads_into_params(*one.params);
  const ModelConfig full = one.model->config();
  const auto ref = weight_tensors(one.model->weights(), full.hidden);
  const int N = 2;
  std::vector<double> loss(N);
  std::vector<std::pair<std::string, std::vector<float>>> got;
  run_ranks(N, [&](ThreadCommunicator& comm) {
    const int rank = comm.rank();
    ThreadPool rank_pool(1);
    auto rank_backend = make_backend(kCpu, rank_pool);
    TrainConfig c = lora_config(N);
    c.method = TrainMethod::full;
    TrainableModel m = load_trainable_model(c, *rank_backend, rank_pool, nullptr, rank);
    EXPECT_FALSE(m.params->replicated_grads_are_partial_sums());
    EXPECT_FALSE(m.params->replicated_ranges().empty());
    auto session = m.params->make_session(*m.model, *rank_backend, BackwardMode::exact);
    CommSums sums(comm);
    session->set_tensor_parallel(&sums, rank, N);
    m.params->zero_grads();
    loss[static_cast<size_t>(rank)] = session->forward_backward(batch, scale).loss_sum * scale;
    grads_into_params(*m.params);
    m.params->gather_tensor_parallel(comm, full);
    if (rank == 0) got = weight_tensors(m.model->weights(), full.hidden);
  });
  for (int r = 0; r < N; ++r) EXPECT_NEAR(loss[static_cast<size_t>(r)], ref_loss, 1e-6 * ref_loss) << "rank " << r;
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    const auto& [name, want] = ref[i];
    ASSERT_EQ(got[i].second.size(), want.size()) << name;
    float largest = 0, worst = 0;
    for (size_t j = 0; j < want.size(); ++j) {
      largest = std::max(largest, std::fabs(want[j]));
      worst = std::max(worst, std::fabs(got[i].second[j] - want[j]));
    }
    EXPECT_GT(largest, 0.0f) << name << ": no gradient";
    EXPECT_LE(worst, 1e-5f * largest) << name;
  }
}

// A rank's columns of a [rows, cols] input draw those columns of the mask one
// process draws for the whole width (MaskWindow), bit for bit; awkward sizes.
TEST(TensorParallel, DropoutWindowIsTheWholeMasksColumns) {
  ThreadPool pool(1);
  auto backend = make_backend(kCpu, pool);
  const int64_t rows = 5, ranks = 3, w = 7, cols = ranks * w;
  std::vector<float> x(static_cast<size_t>(rows * cols)), whole(x.size());
  std::mt19937 rng(5);
  for (float& v : x) v = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);
  backend->dropout(whole.data(), x.data(), rows * cols, 0.3, 17, 4, 9);
  int64_t dropped = 0;
  for (int64_t k = 0; k < ranks; ++k) {
    std::vector<float> mine(static_cast<size_t>(rows * w)), out(mine.size());
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < w; ++j) mine[static_cast<size_t>(i * w + j)] = x[static_cast<size_t>(i * cols + k * w + j)];
    backend->dropout(out.data(), mine.data(), rows * w, 0.3, 17, 4, 9, {w, cols, k * w});
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < w; ++j) {
        const float want = whole[static_cast<size_t>(i * cols + k * w + j)];
        ASSERT_EQ(out[static_cast<size_t>(i * w + j)], want) << "rank " << k << " row " << i << " col " << j;
        dropped += want == 0.0f ? 1 : 0;
      }
  }
  EXPECT_GT(dropped, 0);  // the mask is not all ones
  EXPECT_LT(dropped, rows * cols);
}

// The whole arena cut into every rank's shard and gathered back: the same
// floats; each shard equals the test's own cut (shard_arena).
TEST(TensorParallel, ArenaMapRoundTrips) {
  const int N = 2;
  ThreadPool pool(1);
  auto backend = make_backend(kCpu, pool);
  const TrainableModel one = load_trainable_model(lora_config(1), *backend, pool);
  const ModelConfig full = one.model->config();
  const LoraConfig lc = lora_config(N).lora;
  const LoraModel whole_layout(full, lc);
  std::vector<float> whole(static_cast<size_t>(whole_layout.param_count()));
  std::mt19937 rng(13);
  for (float& v : whole) v = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  std::vector<float> gathered;
  run_ranks(N, [&](ThreadCommunicator& comm) {
    const LoraModel shard(tensor_parallel_config(full, N), lc);
    ASSERT_EQ(lora_tensor_parallel_whole_size(shard, N), whole.size());
    std::vector<float> mine(static_cast<size_t>(shard.param_count()), std::nanf(""));
    take_tensor_parallel_shard(lora_tensor_parallel_runs(shard, comm.rank(), N), whole, mine);
    EXPECT_EQ(mine, shard_arena(whole, full, lc, comm.rank(), N)) << "rank " << comm.rank();
    std::vector<float> back;
    gather_tensor_parallel_arena(comm, shard, mine, back);
    if (comm.rank() == 0) gathered = back;
  });
  EXPECT_EQ(gathered, whole);
}

// Full fine-tuning: one process's arena (the whole layout of checkpoints) cut
// by the map is each rank's arena as the loader cut it (model/tensor_parallel.h),
// bit for bit, and every rank's gathered back is one process's again.
TEST(TensorParallel, FullArenaMapIsTheLoadersCut) {
  const int N = 2;
  ThreadPool pool(1);
  auto backend = make_backend(kCpu, pool);
  TrainConfig c1 = lora_config(1);
  c1.method = TrainMethod::full;
  TrainableModel one = load_trainable_model(c1, *backend, pool);
  const std::vector<float> whole(one.params->params().begin(), one.params->params().end());
  std::vector<float> gathered;
  run_ranks(N, [&](ThreadCommunicator& comm) {
    ThreadPool rank_pool(1);
    auto rank_backend = make_backend(kCpu, rank_pool);
    TrainConfig c = lora_config(N);
    c.method = TrainMethod::full;
    TrainableModel m = load_trainable_model(c, *rank_backend, rank_pool, nullptr, comm.rank());
    ASSERT_EQ(m.params->tensor_parallel_whole_size(), whole.size());
    std::vector<float> mine(m.params->params().size(), std::nanf(""));
    m.params->take_tensor_parallel_shard(whole, mine);
    const std::vector<float> loaded(m.params->params().begin(), m.params->params().end());
    EXPECT_EQ(mine, loaded) << "rank " << comm.rank();
    std::vector<float> back;
    m.params->gather_tensor_parallel_array(comm, mine, back);
    if (comm.rank() == 0) gathered = back;
  });
  EXPECT_EQ(gathered, whole);
}

// With LoRA dropout 0.1 at micro-batch counter 5: N ranks draw the masks of one
// process (o/down: their columns of it), so loss and gradients match as without.
TEST(TensorParallel, DropoutRanksEqualOneProcess) {
  const Batch batch = make_batch();
  const double p = 0.1;
  const uint64_t step = 5;
  const Reference ref = whole_model_step(batch, p, step);
  const Reference undropped = whole_model_step(batch, 0, step);
  ASSERT_GT(std::fabs(ref.loss - undropped.loss), 1e-4 * ref.loss);  // the dropout changes the step
  const int N = 2;  // the tiny model's 2 kv heads
  const LoraConfig lc = lora_config(N, p).lora;
  std::vector<double> loss(static_cast<size_t>(N));
  std::vector<float> gathered;
  run_ranks(N, [&](ThreadCommunicator& comm) {
    const int rank = comm.rank();
    ThreadPool pool(1);
    auto backend = make_backend(kCpu, pool);
    TrainableModel m = load_trainable_model(lora_config(N, p), *backend, pool, nullptr, rank);
    loss[static_cast<size_t>(rank)] = shard_step(comm, m, *backend, ref, lc, batch, step).loss;
    const std::span<float> g = m.params->grads();
    std::vector<float> whole;
    m.params->gather_tensor_parallel_array(comm, g, whole);
    if (rank == 0) gathered = whole;
  });
  for (int r = 0; r < N; ++r) EXPECT_NEAR(loss[static_cast<size_t>(r)], ref.loss, 1e-6 * ref.loss) << "rank " << r;
  expect_close_tensors(gathered, ref.grads, ref.config, lc, 1e-5);
}

}  // namespace
}  // namespace loom
