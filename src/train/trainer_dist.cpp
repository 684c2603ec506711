// The Trainer under data parallel (TrainRuntime::comm with N > 1 ranks). A
// step of N ranks with grad_accum G is the step of one process with grad_accum
// N * G over the same rows: rank R takes micro-batches R*G .. R*G+G-1 of the
// step's N*G (the loader's cursor stays global, so checkpoints do not depend
// on N), draws the dropout masks that micro-batch would draw, and the
// gradients, scaled by 1 / (the step's target tokens over all ranks), are
// summed over the ranks by the GradientReducer while the last backward runs.
#include <algorithm>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/mapped_file.h"
#include "train/train_log.h"
#include "train/memory.h"
#include "train/trainer.h"

namespace loom {

// The data- and model-parallel groups (trainer.h), before the model loads: a
// tensor-parallel shard is the model rank's. Splits are collectives: every
// rank calls this.
void Trainer::setup_rank_groups() {
  const int m = model_ranks();
  if (world() % m != 0)
    fail(ErrorKind::invalid_input, "{}: dist.tp {} x dist.pp {} makes groups of {} ranks: run a multiple of {} (mpirun "
         "-np {} for one group, -np {} for 2 data-parallel groups); this run has {}", c_.source, c_.dist.tp,
         c_.dist.pp, m, m, m, 2 * m, world());
  if (world() == 1) return;
  if (model_ranks() == 1) {
    data_comm_ = rt_.comm;
    return;
  }
  Communicator* model = rt_.comm;
  if (data_ranks() > 1) {
    model_group_ = rt_.comm->split(data_rank(), rank());
    data_group_ = rt_.comm->split(model_rank(), rank());
    model = model_group_.get();
    data_comm_ = data_group_.get();
  }
  if (c_.dist.tp > 1 && c_.dist.pp > 1) {
    tp_group_ = model->split(stage(), model_rank());
    pp_group_ = model->split(tp_rank(), model_rank());
    tp_comm_ = tp_group_.get();
    pp_comm_ = pp_group_.get();
  } else {
    (c_.dist.tp > 1 ? tp_comm_ : pp_comm_) = model;
  }
  log_->record(LogLevel::info, "dist",
               fmt::format("{} ranks: {} data-parallel group{} of {} ({} tensor-parallel x {} pipeline); this rank: "
                           "data rank {}, stage {}, tensor-parallel rank {}", world(), data_ranks(),
                           data_ranks() == 1 ? "" : "s", model_ranks(), c_.dist.tp, c_.dist.pp, data_rank(), stage(),
                           tp_rank()),
               {{"dist", {{"ranks", world()}, {"data_ranks", data_ranks()}, {"model_ranks", model_ranks()},
                          {"tp", c_.dist.tp}, {"pp", c_.dist.pp}}}});
}

void Trainer::setup_data_parallel() {
  if (data_ranks() == 1) return;
  std::vector<GradMatrix> matrices;
  for (const TensorSpan& t : params_->tensor_spans())  // vectors as one row
    matrices.push_back({t.offset, std::max<int64_t>(t.rows, 1), static_cast<int64_t>(t.size) / std::max<int64_t>(t.rows, 1)});
  GradSyncOptions o = c_.dist.sync;
  o.seed = c_.seed;
  reducer_ = std::make_unique<GradientReducer>(*data_comm_, params_->grads(), params_->layer_ranges(),
                                               std::move(matrices), o);
  const GradSyncOptions& s = reducer_->options();
  std::string how = s.compression == GradCompression::none ? std::string("uncompressed")
                    : s.compression == GradCompression::topk
                        ? fmt::format("top-k {:.3g}% with error feedback", 100 * s.topk_ratio)
                        : fmt::format("PowerSGD rank {} with error feedback", s.powersgd_rank);
  log_->record(LogLevel::info, "dist",
               fmt::format("data parallel: {}; a step is {} ranks x {} x {} rows; gradients in {} buckets of up to "
                           "{}, {}, {}{}, all-reduce {}",
                           data_comm_->describe(), data_ranks(), c_.grad_accum, c_.batch_size, reducer_->bucket_count(),
                           format_bytes(static_cast<int64_t>(s.bucket_bytes)),
                           s.overlap ? "overlapped with the backward" : "after the backward", how,
                           s.deterministic ? ", deterministic (rank order)" : "",
                           collective_algorithm_name(c_.dist.algorithm)),
               {{"dist", {{"ranks", data_ranks()}, {"library", data_comm_->describe()}, {"buckets", reducer_->bucket_count()},
                          {"bucket_bytes", s.bucket_bytes}, {"overlap", s.overlap},
                          {"deterministic", s.deterministic}, {"compression", grad_compression_name(s.compression)},
                          {"algorithm", collective_algorithm_name(c_.dist.algorithm)}}}});
  log_zero_shard();
}

// dist.compression from step dist.compression_warmup on (as torch's PowerSGD
// hook's start_powerSGD_iter; default 0: 20 plain steps of 200 did not help
// the main job, bench/results/dist_convergence_warmup20.txt).
void Trainer::update_compression(int64_t step) {
  if (!reducer_ || reducer_->options().compression == GradCompression::none) return;
  const int64_t warm = c_.dist.compression_warmup;
  const bool on = step >= warm;
  const bool was = reducer_->compression_enabled();
  reducer_->set_compression_enabled(on);
  if (opt_->config().sparse_gradients) opt_->set_sparse_gradients(on);  // top-k's lazy moments
  if (!on) return;
  if (!was || step == 0)
    log_->record(LogLevel::info, "dist",
                 fmt::format("dist.compression {} from step {}", grad_compression_name(reducer_->options().compression),
                             step + 1),
                 {{"dist", {{"compression", grad_compression_name(reducer_->options().compression)},
                            {"from_step", step + 1}}}});
}

void Trainer::log_zero_shard() {
  if (zero_cuts_.empty()) return;
  const auto R = static_cast<size_t>(data_rank());
  log_->record(LogLevel::info, "dist",
               fmt::format("ZeRO-1: rank 0 keeps the optimizer state of {} of {} parameters ({}; each rank about 1/{})",
                           zero_cuts_[R + 1] - zero_cuts_[R], params_->count(), format_bytes(static_cast<int64_t>(
                               opt_->state_bytes())), data_ranks()),
               {{"zero", {{"stage", 1}, {"parameters", zero_cuts_[R + 1] - zero_cuts_[R]},
                          {"optimizer_bytes", opt_->state_bytes()}}}});
}

void Trainer::load_step_batches(StepReport& r) {
  const auto G = static_cast<int64_t>(micro_.size());
  const int64_t W = data_ranks(), R = data_rank();
  for (int64_t k = 0; k < W * G; ++k) {
    if (k / G != R) {
      loader_->skip();  // another rank's micro-batch
      continue;
    }
    Batch& b = micro_[static_cast<size_t>(k % G)];
    loader_->next(b);  // into the batch's own memory
    r.target_tokens += b.target_tokens;
  }
}

// The step's micro-batches of this rank; the last one's backward hands each
// finished layer to the reducer. Returns the local loss sum.
double Trainer::backward_step(float scale, int64_t step) {
  if (c_.dist.pp > 1) {  // trainer_pp.cpp; then the sum over the data-parallel groups, after the pipeline's flush
    const double loss_sum = pipeline_step(scale, step);
    finish_reduction();
    params_->sum_tied_stage_grads(*pp_comm_);  // full fine-tuning: after the data-parallel sum, alike on both stages
    sum_replicated_grads();  // tensor parallel inside the stages (trainer_tp.cpp)
    return loss_sum;
  }
  const auto G = static_cast<int64_t>(micro_.size());
  const int64_t W = data_ranks(), R = data_rank();
  int64_t last = -1;
  for (int64_t i = 0; i < G; ++i)
    if (micro_[static_cast<size_t>(i)].target_tokens > 0) last = i;
  if (reducer_) reducer_->begin_step();
  // dist.deterministic: each micro-batch's gradient is computed on its own and
  // added to the sum of the earlier ones, ((g0 + g1) + g2) ..., the order in
  // which the ranks' gradients are summed: N ranks give the bits of one
  // process with grad_accum N. (Otherwise the kernels accumulate into the arena.)
  const bool separate = c_.dist.sync.deterministic && G > 1;
  const std::span<float> grads = params_->grads();
  bool any = false;
  double loss_sum = 0;
  for (int64_t i = 0; i < G; ++i) {
    const Batch& b = micro_[static_cast<size_t>(i)];
    if (b.target_tokens == 0) continue;
    if (separate && any) {
      accum_.assign(grads.begin(), grads.end());
      params_->zero_grads();
    }
    // Each micro-batch draws its own dropout masks (as PEFT's successive
    // forwards do): counter step * (N G) + R G + i, the one process's numbering.
    const auto mask_counter = static_cast<uint64_t>(step * W * G + R * G + i);
    // The last backward hands each finished layer to the all-reduce (not when
    // the earlier micro-batches' sum is still to be added).
    if (reducer_ && i == last && !(separate && any))
      session_->set_layer_done([this](int64_t l) { reducer_->layer_done(l); });
    loss_sum += session_->forward_backward(b, scale, mask_counter).loss_sum;
    session_->set_layer_done({});
    if (separate && any)
      for (size_t j = 0; j < grads.size(); ++j) grads[j] = accum_[j] + grads[j];
    any = true;
    input_tokens_ += b.rows * b.seq_len;
  }
  finish_reduction();
  sum_replicated_grads();  // tensor parallel (trainer_tp.cpp)
  return loss_sum;
}

// The buckets the last backward did not hand over, and the wait for all.
void Trainer::finish_reduction() {
  if (!reducer_) return;
  TraceScope wait_trace(tracer(), "allreduce_wait");
  if (c_.dist.pp > 1) reducer_->begin_step();  // no backward handed any bucket over
  sync_stats_ = reducer_->finish();
  wait_trace.arg("bytes", static_cast<double>(sync_stats_.wire_bytes));
}

// This rank's share of an evaluation (batches i with i mod N = R), summed over the ranks.
LossResult Trainer::eval_shard(const DataSplit& split) {
  DataLoader loader(split, data_->pad_id, c_.batch_size, /*shuffle=*/false, 0);
  LossResult sum;
  Batch b;  // one batch's memory for every batch
  const int64_t W = data_ranks(), R = data_rank();
  for (int64_t i = 0, nb = loader.batches_per_epoch(); i < nb; ++i) {
    if (i % W != R) {
      loader.skip();
      continue;
    }
    loader.next(b);
    if (b.target_tokens == 0) continue;
    const LossResult r = session_->forward_loss(b);
    sum.loss_sum += r.loss_sum;
    sum.n_tokens += r.n_tokens;
    sum.n_correct += r.n_correct;
  }
  if (W > 1) {
    double v[3] = {sum.loss_sum, static_cast<double>(sum.n_tokens), static_cast<double>(sum.n_correct)};
    data_comm_->allreduce_sum(std::span<double>(v, 3));
    sum.loss_sum = v[0];
    sum.n_tokens = static_cast<int64_t>(v[1]);
    sum.n_correct = static_cast<int64_t>(v[2]);
  }
  return sum;
}

bool Trainer::agree_any(bool local) {
  if (world() == 1) return local;
  int64_t v = local ? 1 : 0;
  rt_.comm->allreduce_max(std::span<int64_t>(&v, 1));
  return v != 0;
}

// `work` runs on rank 0 only; its failure is every rank's (the others would
// otherwise wait for rank 0 in the next collective until dist.timeout).
void Trainer::on_root(std::string_view what, const std::function<void()>& work) {
  if (world() == 1) {
    work();
    return;
  }
  std::string message;
  int64_t head[2] = {-1, 0};  // error kind (-1: none), message length
  if (is_root()) {
    try {
      work();
    } catch (const Error& e) {
      message = e.what();
      head[0] = static_cast<int64_t>(e.kind());
      head[1] = static_cast<int64_t>(message.size());
    }
  }
  rt_.comm->broadcast(head, sizeof(head), 0);
  if (head[0] < 0) return;
  message.resize(static_cast<size_t>(head[1]));
  rt_.comm->broadcast(message.data(), message.size(), 0);
  const auto kind = static_cast<ErrorKind>(head[0]);
  if (is_root()) throw Error(kind, message);
  fail(kind, "rank 0 could not {}: {}", what, message);
}

// ZeRO-1: the arena cut into one contiguous part per rank at tensor bounds,
// each near an equal share of the parameters; rank r keeps the optimizer
// state of part r and updates it. The same cuts on every rank.
OptimizerShard Trainer::zero_shard() {
  zero_cuts_.clear();
  if (data_ranks() == 1 || !c_.dist.zero1) return {};
  std::vector<TensorSpan> spans = params_->tensor_spans();
  std::sort(spans.begin(), spans.end(), [](const TensorSpan& a, const TensorSpan& b) { return a.offset < b.offset; });
  const auto n = static_cast<size_t>(params_->count());
  const auto W = static_cast<size_t>(data_ranks());
  zero_cuts_ = {0};
  for (size_t r = 1; r < W; ++r) {
    const size_t target = n * r / W;
    size_t best = zero_cuts_.back();
    for (const TensorSpan& t : spans)  // the tensor start nearest the target, not before the last cut
      if (t.offset >= zero_cuts_.back() &&
          (best == zero_cuts_.back() || (t.offset > target ? t.offset - target : target - t.offset) <
                                            (best > target ? best - target : target - best)))
        best = t.offset;
    zero_cuts_.push_back(best);
  }
  zero_cuts_.push_back(n);
  const auto R = static_cast<size_t>(data_rank());
  return {zero_cuts_[R], zero_cuts_[R + 1]};
}

void Trainer::gather_zero_params() {
  if (zero_cuts_.empty()) return;
  std::vector<size_t> bytes;
  for (size_t r = 0; r + 1 < zero_cuts_.size(); ++r) bytes.push_back((zero_cuts_[r + 1] - zero_cuts_[r]) * sizeof(float));
  float* p = params_->params().data();
  data_comm_->allgatherv(p + zero_cuts_[static_cast<size_t>(data_rank())], p, bytes);
}

// Rank 0 gets every rank's part of each optimizer state part (rank order is
// the unsharded layout) and `parts` point at the whole; the buffers returned
// hold them. Without ZeRO nothing changes.
std::vector<std::vector<char>> Trainer::gather_zero_state(std::vector<AdamW::StatePart>& parts) {
  std::vector<std::vector<char>> whole;
  if (zero_cuts_.empty()) return whole;
  const auto W = static_cast<size_t>(data_ranks());
  for (AdamW::StatePart& part : parts) {
    std::vector<uint64_t> sizes(W);
    const uint64_t mine = part.bytes;
    data_comm_->allgatherv(&mine, sizes.data(), std::vector<size_t>(W, sizeof(uint64_t)));
    const std::vector<size_t> counts(sizes.begin(), sizes.end());
    std::vector<char> buf(data_rank() == 0 ? part.file_bytes : 0);
    data_comm_->gatherv(part.data, buf.data(), counts, 0);
    part.data = buf.data();
    part.bytes = part.file_bytes;
    part.file_offset = 0;
    whole.push_back(std::move(buf));
  }
  return whole;
}

namespace {
constexpr const char* kResidualFile = "dist_residual.f32";  // every rank's residual, world rank order
constexpr const char* kPowerSgdFile = "dist_powersgd_q.f32";
}  // namespace

std::vector<AdamW::StatePart> Trainer::gather_compression_state(std::vector<float>& residuals, std::vector<float>& q) {
  std::vector<AdamW::StatePart> out;
  if (!reducer_ || reducer_->residual().empty()) return out;
  // Every rank's, not only a model group's: a tensor-parallel shard's (or a
  // pipeline stage's) residual is its own, of its own arena.
  const std::span<float> mine = reducer_->residual();
  const auto W = static_cast<size_t>(world());
  std::vector<uint64_t> sizes(W);
  const uint64_t my_bytes = mine.size_bytes();
  rt_.comm->allgatherv(&my_bytes, sizes.data(), std::vector<size_t>(W, sizeof(uint64_t)));
  const std::vector<size_t> counts(sizes.begin(), sizes.end());
  size_t total = 0;
  for (size_t b : counts) total += b;
  residuals.resize(is_root() ? total / sizeof(float) : 0);
  rt_.comm->gatherv(mine.data(), residuals.data(), counts, 0);
  const size_t rb = residuals.size() * sizeof(float);
  out.push_back({kResidualFile, residuals.data(), rb, 0, rb});
  q = reducer_->powersgd_q();
  const size_t qb = q.size() * sizeof(float);
  if (!q.empty()) out.push_back({kPowerSgdFile, q.data(), qb, 0, qb});
  return out;
}

// The residual of the same rank groups resumes as it was, each rank's its own.
// On another data-parallel rank count without model groups the ranks'
// residuals cannot be mapped one to one: rank 0 takes their sum (what is still
// owed to the update), the others start at zero. Shards of another dist.tp (or
// stages) have other arenas: their residuals are dropped with a warning.
void Trainer::restore_compression_state(const std::string& path, int64_t checkpoint_world,
                                        int checkpoint_tp) {
  if (!reducer_ || reducer_->residual().empty()) return;
  const std::span<float> mine = reducer_->residual();
  std::fill(mine.begin(), mine.end(), 0.0f);
  const std::filesystem::path dir(path);
  std::error_code ec;
  if (!std::filesystem::exists(dir / kResidualFile, ec)) {
    log_->record(LogLevel::warning, "resume",
                 fmt::format("resume: {} holds no gradient-compression state (written without dist.compression): "
                             "the error feedback starts from zero", path));
    return;
  }
  const MappedFile f((dir / kResidualFile).string());
  const size_t n = mine.size();
  const auto* all = reinterpret_cast<const float*>(f.data());
  const bool same_groups = checkpoint_world == data_ranks() && checkpoint_tp == c_.dist.tp &&
                           f.size() == static_cast<size_t>(world()) * n * sizeof(float);
  if (same_groups) {
    std::copy(all + static_cast<size_t>(rank()) * n, all + static_cast<size_t>(rank() + 1) * n, mine.begin());
  } else if (model_ranks() > 1 || checkpoint_tp != 1) {
    log_->record(LogLevel::warning, "resume",
                 fmt::format("resume: {} holds the error-feedback residuals of other rank groups ({} data-parallel "
                             "x dist.tp {}, {} bytes; now {} x dist.tp {}): the error feedback starts from zero",
                             path, checkpoint_world, checkpoint_tp, f.size(), data_ranks(), c_.dist.tp));
    return;
  } else {
    if (checkpoint_world < 1 || f.size() != static_cast<size_t>(checkpoint_world) * n * sizeof(float))
      fail(ErrorKind::invalid_input, "{}: {} holds {} bytes, not {} ranks' residuals of {} gradients", path,
           kResidualFile, f.size(), checkpoint_world, n);
    if (data_rank() == 0)
      for (int64_t r = 0; r < checkpoint_world; ++r)
        for (size_t i = 0; i < n; ++i) mine[i] += all[static_cast<size_t>(r) * n + i];
    log_->record(LogLevel::warning, "resume",
                 fmt::format("resume: the error-feedback residuals of {} ranks go to rank 0 as their sum ({} ranks "
                             "now)", checkpoint_world, data_ranks()));
  }
  if (c_.dist.sync.compression == GradCompression::powersgd && std::filesystem::exists(dir / kPowerSgdFile, ec)) {
    const MappedFile qf((dir / kPowerSgdFile).string());
    reducer_->set_powersgd_q({reinterpret_cast<const float*>(qf.data()), qf.size() / sizeof(float)});
  }
}

void Trainer::broadcast_text(std::string& text) {
  if (world() == 1) return;
  int64_t n = static_cast<int64_t>(text.size());
  rt_.comm->broadcast(&n, sizeof(n), 0);
  text.resize(static_cast<size_t>(n));
  rt_.comm->broadcast(text.data(), text.size(), 0);
}

// Every rank reads the checkpoint itself: they must all find rank 0's.
void Trainer::agree_resume() {
  if (world() == 1) return;
  std::string root_path = resume_path_;
  broadcast_text(root_path);
  if (root_path != resume_path_)
    fail(ErrorKind::invalid_input, "--resume: rank {} finds {} but rank 0 resumes from {}: checkpoint_dir '{}' must "
         "be a folder every rank reads (a shared filesystem)", rank(),
         resume_path_.empty() ? std::string("no checkpoint") : "'" + resume_path_ + "'",
         root_path.empty() ? std::string("nothing") : "'" + root_path + "'", checkpoint_dir_);
}

int Trainer::stop_requested() {
  int64_t sig = rt_.stop_signal ? rt_.stop_signal->load() : 0;
  if (world() > 1) rt_.comm->allreduce_max(std::span<int64_t>(&sig, 1));
  return static_cast<int>(sig);
}

}  // namespace loom
