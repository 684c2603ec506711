// The two TrainableParams: LoRA adapters on frozen weights (a LoraModel arena,
// exported as a PEFT folder) and full fine-tuning (the FullParams arena,
// exported as a Hugging Face folder).
#include "train/trainable.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "model/hf_export.h"
#include "model/lora.h"
#include "model/peft_adapter.h"
#include "model/tensor_parallel.h"
#include "train/full_params.h"
#include "train/full_pp.h"
#include "train/full_tp.h"
#include "train/lora_params.h"
#include "train/lora_tp.h"
#include "train/tp_runs.h"
#include "train/qat.h"

namespace loom {

namespace {

// Parameter groups over the LoRA arena: attention vs MLP adapters, A vs B
// (B flagged for LoRA+); adjacent runs of the same kind are merged.
std::vector<ParamGroup> lora_param_groups(const LoraModel& lora, const TrainConfig& c) {
  struct Run {
    size_t offset, size;
    bool mlp, b;
  };
  std::vector<Run> runs;
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (LoraTarget t : kAllLoraTargets) {
      const LoraSlot& s = lora.slot(l, t);
      if (!s.active) continue;
      const auto r = static_cast<size_t>(lora.config().r);
      const bool mlp = !lora_target_is_attention(t);
      runs.push_back({s.a_offset, r * static_cast<size_t>(s.in), mlp, false});
      runs.push_back({s.b_offset, static_cast<size_t>(s.out) * r, mlp, true});
    }
  std::sort(runs.begin(), runs.end(), [](const Run& x, const Run& y) { return x.offset < y.offset; });
  std::vector<ParamGroup> groups;
  for (const Run& run : runs) {
    if (!groups.empty()) {
      ParamGroup& g = groups.back();
      if (g.offset + g.size == run.offset && g.lora_b == run.b && (g.name[0] == 'm') == run.mlp) {
        g.size += run.size;
        continue;
      }
    }
    ParamGroup g;
    g.name = fmt::format("{}.lora_{}", run.mlp ? "mlp" : "attn", run.b ? "B" : "A");
    g.offset = run.offset;
    g.size = run.size;
    g.lr = run.mlp && c.mlp_lr ? *c.mlp_lr : c.lr;
    g.weight_decay = c.weight_decay;
    g.lora_b = run.b;
    groups.push_back(g);
  }
  if (c.lora_plus_ratio) groups = apply_lora_plus(std::move(groups), *c.lora_plus_ratio);
  return groups;
}

// The adapter in PEFT form: q/k B rows back in Hugging Face order when the
// model stores them permuted (llama from GGUF).
peft::AdapterTensors adapter_tensors(const LoraModel& lora, const ModelConfig& model, const TrainConfig& c) {
  peft::AdapterTensors ad;
  ad.config.r = static_cast<int>(c.lora.r);
  ad.config.lora_alpha = c.lora.alpha;
  ad.config.lora_dropout = c.lora.dropout;
  ad.config.use_rslora = c.lora.use_rslora;
  ad.config.base_model_name_or_path = c.model;
  for (LoraTarget t : kAllLoraTargets)
    if (c.lora.targets_module(t)) ad.config.target_modules.push_back(t);
  const size_t r = static_cast<size_t>(c.lora.r);
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (LoraTarget t : kAllLoraTargets) {
      const LoraSlot& s = lora.slot(l, t);
      if (!s.active) continue;
      peft::LoraPair p;
      p.in = s.in;
      p.out = s.out;
      const float* a = lora.params() + s.a_offset;
      const float* b = lora.params() + s.b_offset;
      p.a.assign(a, a + r * static_cast<size_t>(s.in));
      p.b.assign(b, b + static_cast<size_t>(s.out) * r);
      if (lora_needs_qk_permutation(model) && (t == LoraTarget::q || t == LoraTarget::k))
        lora_permute_qk_rows(make_tensor(p.b.data(), DType::f32, {s.out, c.lora.r}),
                             t == LoraTarget::q ? model.n_heads : model.n_kv_heads, model.head_dim,
                             /*hf_to_model=*/false);
      ad.pairs[{static_cast<int>(l), t}] = std::move(p);
    }
  return ad;
}

class LoraTrainable final : public TrainableParams {
 public:
  LoraTrainable(const ModelConfig& mc, const LoraConfig& config, ThreadPool& pool) : lora_(mc, config), pool_(pool) {}
  // QAT: the model's matrices become fq(W + s B A), refreshed after every update.
  void start_qat(Model& model, TrainSession& session, Backend& backend, const IntQuantSpec& spec) override {
    LOOM_ASSERT(!qat_);
    qat_ = std::make_unique<QatWeights>(model.mutable_weights(), spec, /*lora=*/true);
    session.set_adapters_merged(true);
    after_update(model, session, backend);
  }
  bool qat_started() const override { return qat_ != nullptr; }

  void shard_for_tensor_parallel(const ModelConfig& full, int rank, int ranks) override {
    tp_rank_ = rank;
    tp_ranks_ = ranks;
    const LoraModel whole(full, lora_.config());  // the same seeds: the values a whole model would start from
    LOOM_ASSERT(static_cast<size_t>(whole.param_count()) == lora_tensor_parallel_whole_size(lora_, ranks));
    loom::take_tensor_parallel_shard(lora_tensor_parallel_runs(lora_, rank, ranks),
                                     {whole.params(), static_cast<size_t>(whole.param_count())}, params());
  }
  std::vector<std::pair<size_t, size_t>> replicated_ranges() const override {
    std::vector<std::pair<size_t, size_t>> out;
    for (const TensorParallelRun& run : lora_tensor_parallel_runs(lora_, tp_rank_, tp_ranks_))
      if (run.replicated) out.push_back({run.mine, run.n});
    return out;
  }
  void gather_tensor_parallel(Communicator& comm, const ModelConfig& full) override {
    std::vector<float> all;
    gather_tensor_parallel_arena(comm, lora_, params(), all);
    if (comm.rank() != 0) return;
    LoraModel whole(full, lora_.config());
    LOOM_ASSERT(static_cast<size_t>(whole.param_count()) == all.size());
    std::copy(all.begin(), all.end(), whole.params());
    lora_ = std::move(whole);
  }
  size_t tensor_parallel_whole_size() const override { return lora_tensor_parallel_whole_size(lora_, tp_ranks_); }
  void gather_tensor_parallel_array(Communicator& comm, std::span<const float> mine,
                                    std::vector<float>& whole) const override {
    gather_tensor_parallel_arena(comm, lora_, mine, whole);
  }
  void take_tensor_parallel_shard(std::span<const float> whole, std::span<float> mine) const override {
    loom::take_tensor_parallel_shard(lora_tensor_parallel_runs(lora_, tp_rank_, tp_ranks_), whole, mine);
  }

  std::span<float> params() override { return {lora_.params(), static_cast<size_t>(lora_.param_count())}; }
  std::span<float> grads() override { return {lora_.grads(), static_cast<size_t>(lora_.param_count())}; }
  void zero_grads() override { lora_.zero_grads(); }
  std::string tensor_at(size_t offset) const override { return lora_.tensor_at(offset); }
  std::vector<ParamGroup> param_groups(const TrainConfig& c) const override { return lora_param_groups(lora_, c); }
  std::vector<TensorSpan> tensor_spans() const override {
    std::vector<TensorSpan> out;
    const auto r = static_cast<size_t>(lora_.config().r);
    for (int64_t l = 0; l < lora_.n_layers(); ++l)
      for (LoraTarget t : kAllLoraTargets)
        if (const LoraSlot& s = lora_.slot(l, t); s.active) {
          out.push_back({s.a_offset, r * static_cast<size_t>(s.in), lora_.config().r});
          out.push_back({s.b_offset, static_cast<size_t>(s.out) * r, s.out});
        }
    return out;
  }
  std::vector<std::pair<size_t, size_t>> layer_ranges() const override {
    std::vector<std::pair<size_t, size_t>> out;
    const auto r = static_cast<size_t>(lora_.config().r);
    for (int64_t l = 0; l < lora_.n_layers(); ++l) {
      size_t lo = SIZE_MAX, hi = 0;
      for (LoraTarget t : kAllLoraTargets)
        if (const LoraSlot& s = lora_.slot(l, t); s.active) {
          lo = std::min(lo, s.a_offset);
          hi = std::max(hi, s.b_offset + static_cast<size_t>(s.out) * r);
        }
      out.push_back(lo == SIZE_MAX ? std::pair<size_t, size_t>{0, 0} : std::pair{lo, hi});
    }
    return out;
  }
  std::unique_ptr<TrainSession> make_session(const Model& model, Backend& backend, BackwardMode mode) override {
    return std::make_unique<TrainSession>(model.config(), model.weights(), lora_, backend, mode);
  }
  void after_update(Model& model, TrainSession& session, Backend& backend) override {
    if (!qat_) return;
    qat_->refresh(model.mutable_weights(), pool_, &lora_);
    prepare_weights(model.mutable_weights(), backend);
    session.refresh_weights();
  }
  int64_t added_params() const override { return lora_.param_count(); }
  std::string describe() const override {
    return fmt::format("LoRA r={} alpha={}{}", lora_.config().r, lora_.config().alpha,
                       qat_ ? ", QAT " + qat_->describe() + " on W + s B A" : "");
  }
  const char* output_kind() const override { return "adapter"; }
  void write_output(const Model& model, const TrainConfig& c, const FolderWriteOptions& opt) override {
    peft::write_adapter(c.output_dir, adapter_tensors(lora_, model.config(), c), safetensors::StDType::f32, opt);
  }
  void write_whole_output(std::span<const float> whole, const ModelConfig& full, const TrainConfig& c,
                          const FolderWriteOptions& opt) const override {
    LoraModel w(full, lora_.config());
    if (whole.size() != static_cast<size_t>(w.param_count()))
      fail(ErrorKind::invalid_input, "tensor parallel: {} floats gathered for an adapter of {}", whole.size(),
           w.param_count());
    std::copy(whole.begin(), whole.end(), w.params());
    peft::write_adapter(c.output_dir, adapter_tensors(w, full, c), safetensors::StDType::f32, opt);
  }

 private:
  LoraModel lora_;
  ThreadPool& pool_;
  std::unique_ptr<QatWeights> qat_;
  int tp_rank_ = 0, tp_ranks_ = 1;  // this arena's shard (shard_for_tensor_parallel)
};

class FullTrainable final : public TrainableParams {
 public:
  FullTrainable(ModelWeights& w, const ModelConfig& mc, ThreadPool& pool) : full_(w, mc, pool), pool_(pool), w_(w) {}
  int64_t keep_zeros() {
    masked_ = true;
    return full_.keep_zeros();
  }
  // QAT: the forward multiplies fq(W) of the arena's weights.
  void start_qat(Model& model, TrainSession& session, Backend& backend, const IntQuantSpec& spec) override {
    LOOM_ASSERT(!qat_);
    qat_ = std::make_unique<QatWeights>(model.mutable_weights(), spec, /*lora=*/false);
    after_update(model, session, backend);
  }
  bool qat_started() const override { return qat_ != nullptr; }
  void before_update() override {
    if (masked_) full_.mask_grads();
  }

  std::span<float> params() override { return {full_.params(), static_cast<size_t>(full_.param_count())}; }
  std::span<float> grads() override { return {full_.grads(), static_cast<size_t>(full_.param_count())}; }
  void zero_grads() override { full_.zero_grads(); }
  std::string tensor_at(size_t offset) const override { return full_.tensor_at(offset); }
  std::vector<ParamGroup> param_groups(const TrainConfig& c) const override {
    return full_.param_groups(c.lr, c.weight_decay);
  }
  std::vector<TensorSpan> tensor_spans() const override { return full_.tensor_spans(); }
  std::vector<std::pair<size_t, size_t>> layer_ranges() const override { return full_.layer_ranges(); }
  std::unique_ptr<TrainSession> make_session(const Model& model, Backend& backend, BackwardMode mode) override {
    return std::make_unique<TrainSession>(model.config(), model.weights(), full_, backend, mode);
  }
  void after_update(Model& model, TrainSession& session, Backend& backend) override {
    if (masked_) full_.mask_params();
    if (qat_) qat_->refresh(model.mutable_weights(), pool_, nullptr);
    prepare_weights(model.mutable_weights(), backend);
    session.refresh_weights();
  }
  // Tensor parallel: the weights were cut before the arena took them; the
  // uncut tensors' gradients are alike on every rank (not partial sums).
  void shard_for_tensor_parallel(const ModelConfig&, int rank, int ranks) override {
    tp_rank_ = rank;
    tp_ranks_ = ranks;
  }
  std::vector<std::pair<size_t, size_t>> replicated_ranges() const override {
    return tp_ranks_ > 1 ? full_.unsplit_ranges() : std::vector<std::pair<size_t, size_t>>{};
  }
  bool replicated_grads_are_partial_sums() const override { return false; }
  void gather_tensor_parallel(Communicator& comm, const ModelConfig&) override {
    gather_full_tensor_parallel(comm, w_, whole_);
  }
  bool split_into_stages() const override { return true; }
  size_t bound_weight_bytes() const override { return full_.bound_bytes(); }
  void sum_tied_stage_grads(Communicator& pp) override { sum_tied_embedding_grads(pp, full_.tied_copy_grads()); }
  double stage_sum_squares(Communicator& pp, double local) override {
    if (pp.rank() > 0) {  // the last stage's copy of a tied embedding: the first stage counts it
      const std::span<float> t = full_.tied_copy_grads();
      for (float x : t) local -= static_cast<double>(x) * x;
    }
    pp.allreduce_sum(std::span<double>(&local, 1));
    return local;
  }
  void gather_pipeline(Communicator& pp, Model& model) override {
    gather_full_pipeline(pp, model.mutable_weights(), model.config(), whole_);
  }
  // Checkpoints: the arenas in one process's layout (train/full_tp.h).
  size_t tensor_parallel_whole_size() const override { return full_tensor_parallel_whole_size(full_, tp_ranks_); }
  void gather_tensor_parallel_array(Communicator& comm, std::span<const float> mine,
                                    std::vector<float>& whole) const override {
    LOOM_ASSERT(comm.size() == tp_ranks_ && mine.size() == static_cast<size_t>(full_.param_count()));
    gather_tensor_parallel_runs(comm, mine, tensor_parallel_whole_size(),
                                [&](int k) { return full_tensor_parallel_runs(full_, k, tp_ranks_); }, whole);
  }
  void take_tensor_parallel_shard(std::span<const float> whole, std::span<float> mine) const override {
    loom::take_tensor_parallel_shard(full_tensor_parallel_runs(full_, tp_rank_, tp_ranks_), whole, mine);
  }
  int64_t added_params() const override { return 0; }
  std::string describe() const override {
    return qat_ ? "full fine-tuning (f32), QAT " + qat_->describe() : "full fine-tuning (f32)";
  }
  const char* output_kind() const override { return "Hugging Face model folder"; }
  void write_output(const Model& model, const TrainConfig& c, const FolderWriteOptions& opt) override {
    if (!qat_) {
      write_hf_folder(model, c.output_dir, c.output_dtype, opt);
      return;
    }
    // The trained (latent) weights; `loom quantize` with the QAT scheme then exports what was trained.
    ModelWeights& w = const_cast<Model&>(model).mutable_weights();
    qat_->restore_latent(w);
    try {
      write_hf_folder(model, c.output_dir, c.output_dtype, opt);
    } catch (...) {
      qat_->point_at_fq(w);
      throw;
    }
    qat_->point_at_fq(w);
  }

 private:
  FullParams full_;
  ThreadPool& pool_;
  ModelWeights& w_;  // the model's, pointing into full_'s arena
  int tp_rank_ = 0, tp_ranks_ = 1;  // this arena's shard (shard_for_tensor_parallel)
  std::vector<std::vector<float>> whole_;  // tensor or pipeline parallel, rank 0 at the end: the other ranks' tensors
  bool masked_ = false;
  std::unique_ptr<QatWeights> qat_;
};

// "pipeline stage 1 of 2 holds layers [15, 30), the final norm and the output matrix"
std::string describe_stage(const Model& m) {
  const PipelineStage s = *m.stage();
  const LayerSpan span = pipeline_stage_layers(m.config().n_layers, s);
  std::string extra;
  if (m.weights().token_embd.data != nullptr) extra += ", the token embedding";
  if (m.weights().output.data != nullptr) extra += ", the final norm and the output matrix";
  return fmt::format("pipeline stage {} of {} holds layers [{}, {}){} ({:.1f} MiB of weights)", s.index, s.count,
                     span.first, span.last, extra, static_cast<double>(m.weight_bytes()) / (1 << 20));
}

}  // namespace

bool wants_sparsity_mask(const TrainConfig& c, const ModelConfig& mc) {
  using M = TrainConfig::SparsityMask;
  return c.sparsity_mask == M::on || (c.sparsity_mask == M::automatic && !mc.unstructured_pruning.empty());
}

void TrainableParams::shard_for_tensor_parallel(const ModelConfig&, int, int) {
  fail(ErrorKind::unsupported, "tensor parallel (dist.tp) trains LoRA adapters in this build; method: full is not "
       "split yet");
}

void TrainableParams::gather_tensor_parallel(Communicator&, const ModelConfig&) {
  fail(ErrorKind::unsupported, "tensor parallel (dist.tp) trains LoRA adapters in this build");
}

size_t TrainableParams::tensor_parallel_whole_size() const {
  fail(ErrorKind::unsupported, "checkpoints of tensor parallel (dist.tp) hold LoRA adapters only in this build");
}

void TrainableParams::gather_tensor_parallel_array(Communicator&, std::span<const float>, std::vector<float>&) const {
  fail(ErrorKind::unsupported, "checkpoints of tensor parallel (dist.tp) hold LoRA adapters only in this build");
}

void TrainableParams::write_whole_output(std::span<const float>, const ModelConfig&, const TrainConfig&,
                                         const FolderWriteOptions&) const {
  fail(ErrorKind::unsupported, "a tensor-parallel run's output at a checkpoint is written for LoRA adapters only");
}

void TrainableParams::take_tensor_parallel_shard(std::span<const float>, std::span<float>) const {
  fail(ErrorKind::unsupported, "checkpoints of tensor parallel (dist.tp) hold LoRA adapters only in this build");
}

TrainableModel load_trainable_model(const TrainConfig& c, Backend& backend, ThreadPool& pool,
                                    std::vector<std::string>* notes, int tp_rank, int pp_stage) {
  auto note = [&](std::string s) {
    if (notes != nullptr) notes->push_back(std::move(s));
  };
  TrainableModel out;
  Model::LoadOptions lo{.tokenizer = true, .pack = true, .backend = &backend};
  // Full fine-tuning and QAT use the weights' values (their gradients and fake
  // quantization know no output scale); LoRA's forward and backward apply it.
  lo.fold_output_scales = c.method == TrainMethod::full || c.qat.enabled();
  if (c.quantize_base != TrainConfig::BaseQuant::none) {
    if (c.method == TrainMethod::full)
      fail(ErrorKind::invalid_input,
           "quantize_base: {} freezes a quantized base, so it needs method: lora (full fine-tuning trains the "
           "weights in f32)",
           base_quant_name(c.quantize_base));
    using Q = TrainConfig::BaseQuant;
    lo.quantize_base = c.quantize_base == Q::nf4 ? DType::nf4 : c.quantize_base == Q::q4_0 ? DType::q4_0 : DType::q8_0;
  }
  const int tp = c.dist.tp;
  if (c.method == TrainMethod::full)
    lo.before_pack = [&](ModelWeights& w, const ModelConfig& mc) {
      if (tp > 1) shard_weights_for_tensor_parallel(w, mc, tp_rank, tp);  // the arena takes this rank's shard
      auto full = std::make_unique<FullTrainable>(w, tp > 1 ? tensor_parallel_config(mc, tp) : mc, pool);
      if (wants_sparsity_mask(c, mc)) {
        const int64_t zeros = full->keep_zeros();
        note(fmt::format("sparsity_mask: {} zero weights of the linear layers stay zero{}", zeros,
                         mc.unstructured_pruning.empty() ? "" : " (" + mc.unstructured_pruning + ")"));
      }
      out.params = std::move(full);
    };
  if (tp > 1 && c.method == TrainMethod::lora)
    lo.before_pack = [&](ModelWeights& w, const ModelConfig& mc) { shard_weights_for_tensor_parallel(w, mc, tp_rank, tp); };
  if (c.dist.pp > 1) {
    if (c.method == TrainMethod::full && tp > 1)
      fail(ErrorKind::unsupported, "{}: method: full with both dist.pp {} and dist.tp {} is not built yet (each "
           "works alone)", c.source, c.dist.pp, tp);
    lo.stage = PipelineStage{pp_stage, c.dist.pp};
  }
  out.model = Model::load(c.model, lo);
  const ModelConfig full = out.model->config();
  if (c.dist.pp > 1) note(describe_stage(*out.model));
  if (tp > 1) {
    out.model->reshape(tensor_parallel_config(full, tp));
    note(fmt::format("tensor parallel: rank {} of {} holds {} of {} heads, {} of {} kv heads, {} of {} MLP channels",
                     tp_rank, tp, out.model->config().n_heads, full.n_heads, out.model->config().n_kv_heads,
                     full.n_kv_heads, out.model->config().intermediate, full.intermediate));
  }
  if (c.method == TrainMethod::lora) {
    auto lora = std::make_unique<LoraTrainable>(out.model->config(), c.lora, pool);
    if (!out.model->config().unstructured_pruning.empty())
      note(fmt::format("the model is pruned ({}): LoRA trains on it as it is; merging the adapter (loom merge, "
                       "export) keeps its zeros", out.model->config().unstructured_pruning));
    out.params = std::move(lora);
  }
  LOOM_ASSERT(out.params);
  if (tp > 1) out.params->shard_for_tensor_parallel(full, tp_rank, tp);
  return out;
}

}  // namespace loom
