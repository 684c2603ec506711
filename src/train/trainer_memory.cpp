// The Trainer's memory accounting (train/memory.h): its arenas from the
// buffers that hold them, the estimate and limit check before step 1, and the
// memory_alarm check after every step.
#include <algorithm>

#include "core/error.h"
#include "io/gguf.h"
#include "train/train_log.h"
#include "train/train_metrics.h"
#include "train/train_metrics.h"
#include "train/trainer.h"

namespace loom {

namespace {

size_t samples_bytes(const SampleSet& s) {
  return s.offsets.capacity() * sizeof(int64_t) + (s.ids.capacity() + s.labels.capacity()) * sizeof(int32_t);
}

size_t rows_bytes(const PackedRows& r) {
  return (r.samples.capacity() + r.row_offsets.capacity()) * sizeof(int64_t);
}

// The token cache (tokenized samples; an eval split shares the train file's) and the packed rows.
size_t data_bytes(const TrainData& d) {
  size_t n = samples_bytes(*d.train.samples) + rows_bytes(d.train.rows);
  if (d.eval) {
    if (d.eval->samples != d.train.samples) n += samples_bytes(*d.eval->samples);
    n += rows_bytes(d.eval->rows);
  }
  return n;
}

// The frozen weights as the file maps them (GGUF: every tensor's bytes). With
// quantize_base the layer matrices are owned copies and their file pages are
// released, and a pipeline stage reads only its own tensors: the weights' own
// sizes count then.
size_t mapped_weight_bytes(const Model& m) {
  if (const gguf::File* f = m.gguf_file(); f != nullptr && m.weights().owned_bytes.empty() && !m.stage()) {
    size_t n = 0;
    for (const gguf::TensorInfo& t : f->tensors()) n += t.nbytes;
    return n;
  }
  return m.weight_bytes();
}

size_t prepared_bytes(const ModelWeights& w) {
  size_t n = w.output_prepared ? w.output_prepared->nbytes() : 0;
  for (const PreparedLayer& L : w.prepared)
    for (const WeightHandle* h : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down})
      if (*h) n += (*h)->nbytes();
  return n;
}

}  // namespace

// planned_tokens > 0: the buffers a step of that many tokens allocates, as it
// will allocate them; 0: the buffers as they are now.
std::vector<MemoryArena> Trainer::memory_arenas(int64_t planned_tokens) const {
  const size_t n_params = params_->params().size();
  // Pipeline parallel keeps a session (activations, scratch, workspace) per micro-batch; they are alike.
  const size_t sessions = 1 + stage_sessions_.size();
  size_t activations = 0, scratch = 0, ws = 0, loss = 0;
  for (size_t i = 0; i < sessions; ++i) {
    const TrainSession& s = i == 0 ? *session_ : *stage_sessions_[i - 1];
    activations += s.activation_bytes();
    scratch += s.scratch_bytes();
    ws += s.workspace().bytes();
    loss += s.workspace().loss_bytes();
  }
  size_t batches = 0;
  for (const Batch& b : micro_) batches += b.capacity_bytes();
  if (planned_tokens > 0) {
    activations = std::max(activations, sessions * session_->activation_bytes_for(planned_tokens));
    scratch = std::max(scratch, sessions * session_->scratch_bytes_for(planned_tokens));
    const Backend::WorkspaceBytes w =
        backend_->workspace_bytes(session_->workspace_shape(planned_tokens));
    ws = std::max(ws, sessions * w.total);
    loss = std::max(loss, sessions * w.loss);
    // grad_accum micro-batches of four int32 vectors, plus evaluation's one.
    batches = std::max(batches, static_cast<size_t>(c_.grad_accum + 1) * 4 * sizeof(int32_t) *
                                    static_cast<size_t>(planned_tokens));
  }
  auto i64 = [](size_t n) { return static_cast<int64_t>(n); };
  const int64_t values[kMemoryArenaCount] = {
      // A stage's full fine-tuning: Model::weight_bytes would count the f32 arena (trainable) again.
      i64(model_->stage() && params_->bound_weight_bytes() > 0 ? params_->bound_weight_bytes()
                                                               : mapped_weight_bytes(*model_)),
      i64(prepared_bytes(model_->weights())),
      i64(session_->transposed_bytes()),
      i64(n_params * sizeof(float)),
      i64(params_->grads().size() * sizeof(float)),
      i64(opt_->state_bytes()),  // adamw: 8 bytes a parameter; adamw8bit: ~2.03
      i64(activations),
      i64(scratch + ws - loss),
      i64(loss),
      i64(data_bytes(*data_) + batches)};
  std::vector<MemoryArena> out;
  out.reserve(kMemoryArenaCount);
  for (int i = 0; i < kMemoryArenaCount; ++i) out.push_back({kMemoryArenaNames[i], values[i]});
  return out;
}

MemoryReport Trainer::memory_report() const {
  LOOM_ASSERT(opt_);  // setup() ran
  MemoryReport r;
  r.arenas = memory_arenas(0);
  for (const MemoryArena& a : r.arenas) r.accounted += a.bytes;
  r.rss = process_rss_bytes();
  r.limit = mem_limit_.bytes;
  r.limit_source = mem_limit_.source;
  r.alarm_level = mem_alarm_ ? mem_alarm_->level() : 0;
  return r;
}

void Trainer::estimate_memory() {
  const int64_t tokens = c_.batch_size * c_.seq_len;  // the largest micro-batch
  MemoryEstimate& e = mem_estimate_;
  e.arenas = memory_arenas(tokens);
  e.seq_len = c_.seq_len;
  e.batch_rows = c_.batch_size;
  // Resident now: the weights (read while they were prepared), their copies,
  // the parameters, gradients and data; not yet: the optimizer's moments and
  // everything a step allocates. Whatever else RSS holds is "other".
  int64_t resident = 0;
  for (const MemoryArena& a : e.arenas)
    if (a.name != "optimizer" && a.name != "activations" && a.name != "backward_scratch" && a.name != "loss")
      resident += a.bytes;
  e.other = std::max<int64_t>(0, process_rss_bytes() - resident);
  e.total = e.other;
  for (const MemoryArena& a : e.arenas) e.total += a.bytes;
  mem_limit_ = resolve_memory_limit(c_.memory_limit);
  nlohmann::json arenas = nlohmann::json::object();
  for (const MemoryArena& a : e.arenas) arenas[a.name] = a.bytes;
  arenas["other"] = e.other;
  nlohmann::json record = {{"estimate", e.total}, {"arenas", arenas}, {"limit", mem_limit_.bytes},
                           {"limit_source", memory_limit_source_name(mem_limit_.source)}};
  std::string stages;
  if (c_.dist.pp > 1) {
    nlohmann::json per_stage = nlohmann::json::array();
    for (const MemoryEstimate& st : stage_estimates(e)) {
      nlohmann::json a = {{"other", st.other}, {"total", st.total}};
      for (const MemoryArena& x : st.arenas) a[x.name] = x.bytes;
      per_stage.push_back(std::move(a));
      stages += (stages.empty() ? "; pipeline stages: " : ", ") + format_bytes(st.total);
    }
    record["stages"] = std::move(per_stage);
  }
  log_->record(LogLevel::info, "memory",
               fmt::format("memory: {}; limit {} ({}){}", format_memory_estimate(e), format_bytes(mem_limit_.bytes),
                           memory_limit_source_name(mem_limit_.source), stages),
               {{"memory", record}});
  check_memory_estimate(e, mem_limit_, c_.source);
}

// The stages differ (layers, the embedding on the first, the head on the
// last): rank 0, which alone logs, reports each one's estimate.
std::vector<MemoryEstimate> Trainer::stage_estimates(const MemoryEstimate& e) const {
  std::vector<int64_t> mine;
  for (const MemoryArena& a : e.arenas) mine.push_back(a.bytes);
  mine.push_back(e.other);
  mine.push_back(e.total);
  const size_t ranks = static_cast<size_t>(world()), n = mine.size();
  std::vector<int64_t> all(rank() == 0 ? ranks * n : 0);
  rt_.comm->gatherv(mine.data(), all.data(), std::vector<size_t>(ranks, n * sizeof(int64_t)), 0);
  std::vector<MemoryEstimate> out(all.size() / n, e);
  for (size_t r = 0; r < out.size(); ++r) {
    const int64_t* v = all.data() + r * n;
    for (size_t i = 0; i < e.arenas.size(); ++i) out[r].arenas[i].bytes = v[i];
    out[r].other = v[n - 2];
    out[r].total = v[n - 1];
  }
  return out;
}

// Every buffer of a step sized once, here: the steady-state step allocates nothing.
void Trainer::reserve_step_buffers() {
  const int64_t tokens = c_.batch_size * c_.seq_len;  // the largest micro-batch
  session_->reserve(tokens);
  for (auto& s : stage_sessions_) s->reserve(tokens);  // pipeline parallel's other micro-batches
  for (Batch& b : micro_)
    for (std::vector<int32_t>* v : {&b.tokens, &b.targets, &b.positions, &b.seq_start})
      v->reserve(static_cast<size_t>(tokens));
  res_.step_losses.reserve(static_cast<size_t>(total_steps_));
  mem_alarm_.emplace(c_.memory_alarm, mem_limit_.bytes);
}

bool Trainer::watch_memory() {
  if (!mem_alarm_) return false;
  const int64_t rss = process_rss_bytes();
  const std::optional<MemoryAlarm::Change> ch = mem_alarm_->update(rss);
  if (rt_.metrics) {  // loom_train_memory_bytes{arena}, RSS, limit, alarm level
    MemoryFigures f;
    for (const MemoryArena& a : memory_arenas(0)) f.arenas.emplace_back(a.name, a.bytes);
    f.rss_bytes = rss;
    f.limit_bytes = mem_limit_.bytes;
    f.alarm_level = mem_alarm_->level();
    rt_.metrics->on_memory(f);
  }
  if (rt_.metrics) {  // loom_train_memory_bytes{arena}, _rss_bytes, _limit_bytes, _alarm_level
    const MemoryReport m = memory_report();
    MemoryFigures f{{}, m.rss, m.limit, m.alarm_level};
    for (const MemoryArena& a : m.arenas) f.arenas.emplace_back(a.name, a.bytes);
    rt_.metrics->on_memory(f);
  }
  if (!ch) return false;
  const bool up = ch->to > ch->from;
  const bool top = up && ch->to == mem_alarm_->levels();
  log_->record(up ? LogLevel::warning : LogLevel::info, "memory_alarm",
               fmt::format("memory alarm {}: RSS {} is {:.1f}% of the limit {} ({} {:.0f}%){}",
                           up ? "raised" : "cleared", format_bytes(rss), 100 * ch->fraction,
                           format_bytes(mem_limit_.bytes), up ? "at or above" : "back below",
                           100 * ch->threshold, top ? "; writing a checkpoint" : ""),
               {{"step", steps_done()},
                {"memory", {{"rss", rss}, {"limit", mem_limit_.bytes}, {"fraction", ch->fraction},
                            {"threshold", ch->threshold}, {"alarm_level", ch->to}}}},
               "alert");
  // At the top threshold the OS may kill the run next: keep what it has done.
  return top;
}

}  // namespace loom
