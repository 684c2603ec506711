// AdamW, clipping and LR schedules; the arithmetic follows torch's
// single-tensor AdamW step in fp32 so results match it to rounding.
#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>

#include "core/error.h"
#include "core/mapped_file.h"
#include "io/file_write.h"
#include "kernels/blockwise8.h"

namespace loom {

const char* optimizer_kind_name(OptimizerKind k) { return k == OptimizerKind::adamw8bit ? "adamw8bit" : "adamw"; }

const char* lr_schedule_name(LrScheduleKind k) {
  switch (k) {
    case LrScheduleKind::constant: return "constant";
    case LrScheduleKind::linear: return "linear";
    case LrScheduleKind::cosine: return "cosine";
  }
  return "?";
}

LrScheduleKind lr_schedule_from_name(std::string_view name) {
  if (name == "constant") return LrScheduleKind::constant;
  if (name == "linear") return LrScheduleKind::linear;
  if (name == "cosine") return LrScheduleKind::cosine;
  fail(ErrorKind::invalid_input, "unknown learning-rate schedule '{}' (expected constant, linear or cosine)", name);
}

double LrSchedule::multiplier(int64_t step) const {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  if (step < warmup_steps) return d(step) / d(std::max<int64_t>(1, warmup_steps));
  const double span = d(std::max<int64_t>(1, total_steps - warmup_steps));
  switch (kind) {
    case LrScheduleKind::constant: return 1.0;
    case LrScheduleKind::linear: return std::max(0.0, d(total_steps - step) / span);
    case LrScheduleKind::cosine: {
      const double progress = d(step - warmup_steps) / span;
      return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * num_cycles * 2.0 * progress)));
    }
  }
  return 1.0;
}

std::vector<ParamGroup> apply_lora_plus(std::vector<ParamGroup> groups, double ratio) {
  for (auto& g : groups)
    if (g.lora_b) g.lr *= ratio;
  return groups;
}

double grad_global_norm(std::span<const float> grads) {
  double s = 0;
  for (float g : grads) s += static_cast<double>(g) * g;
  return std::sqrt(s);
}

float clip_coefficient(double norm, double max_norm) {
  return std::min(1.0f, static_cast<float>(max_norm) / (static_cast<float>(norm) + 1e-6f));
}

double clip_grad_global_norm(std::span<float> grads, double max_norm, double* scale) {
  const double norm = grad_global_norm(grads);
  // torch computes the coefficient in fp32 and always multiplies (by 1 when not clipping).
  const float coef = clip_coefficient(norm, max_norm);
  if (coef < 1.0f)
    for (float& g : grads) g *= coef;
  if (scale) *scale = coef;
  return norm;
}

AdamW::AdamW(Backend& backend, AdamWConfig config, std::vector<ParamGroup> groups, size_t n_params,
             LrSchedule schedule, OptimizerKind kind, std::vector<TensorSpan> tensors, OptimizerShard shard)
    : config_(config), groups_(std::move(groups)), schedule_(schedule), be_(backend), kind_(kind), n_(n_params),
      shard_{std::min(shard.begin, n_params), std::min(shard.end, n_params)} {
  if (shard_.begin > shard_.end)
    fail(ErrorKind::invalid_input, "optimizer shard [{}, {}) is empty or reversed", shard.begin, shard.end);
  std::vector<std::pair<size_t, size_t>> spans;
  for (const auto& g : groups_) {
    if (g.offset > n_params || g.size > n_params - g.offset)
      fail(ErrorKind::invalid_input, "optimizer group '{}': [{}, {}) is outside the {} parameters", g.name, g.offset,
           g.offset + g.size, n_params);
    if (!(g.lr >= 0) || !(g.weight_decay >= 0))
      fail(ErrorKind::invalid_input, "optimizer group '{}': lr {} and weight_decay {} must be >= 0", g.name, g.lr,
           g.weight_decay);
    spans.emplace_back(g.offset, g.offset + g.size);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second)
      fail(ErrorKind::invalid_input, "optimizer groups overlap at parameter {}", spans[i].first);
  if (!(config_.beta1 >= 0 && config_.beta1 < 1 && config_.beta2 >= 0 && config_.beta2 < 1 && config_.eps > 0))
    fail(ErrorKind::invalid_input, "AdamW: betas ({}, {}) must be in [0, 1) and eps {} > 0", config_.beta1,
         config_.beta2, config_.eps);
  plan_segments(tensors);
  keep_shard();
  m_ = backend.alloc(n_f32_ * sizeof(float));
  v_ = backend.alloc(n_f32_ * sizeof(float));
  if (config_.sparse_gradients) {
    if (kind_ != OptimizerKind::adamw)
      fail(ErrorKind::invalid_input, "optim.kind {} cannot take sparse gradients (dist.compression topk): its 8-bit "
           "moments have no lazy update; use optim.kind adamw", optimizer_kind_name(kind_));
    gap_ = backend.alloc(n_f32_ * sizeof(float));
  }
  if (kind_ != OptimizerKind::adamw8bit) return;
  mq_ = backend.alloc(n_q8_);
  vq_ = backend.alloc(n_q8_);
  ma_ = backend.alloc(n_blocks_ * sizeof(float));
  va_ = backend.alloc(n_blocks_ * sizeof(float));
  maps_ = backend.alloc(2 * sizeof(Blockwise8Map));
  auto* maps = static_cast<Blockwise8Map*>(maps_.data());
  build_blockwise8_map(maps[0], /*is_signed=*/true);
  build_blockwise8_map(maps[1], /*is_signed=*/false);
}

void AdamW::plan_segments(const std::vector<TensorSpan>& tensors) {
  if (kind_ == OptimizerKind::adamw) {  // the moments mirror the parameter arena
    for (size_t i = 0; i < groups_.size(); ++i)
      segments_.push_back({groups_[i].offset, groups_[i].size, i, false, groups_[i].offset, 0});
    n_f32_ = n_;
    return;
  }
  std::vector<TensorSpan> ts = tensors;
  std::sort(ts.begin(), ts.end(), [](const TensorSpan& a, const TensorSpan& b) { return a.offset < b.offset; });
  for (size_t i = 0; i < ts.size(); ++i) {
    if (ts[i].offset > n_ || ts[i].size > n_ - ts[i].offset)
      fail(ErrorKind::invalid_input, "optimizer tensor [{}, {}) is outside the {} parameters", ts[i].offset,
           ts[i].offset + ts[i].size, n_);
    if (i > 0 && ts[i].offset < ts[i - 1].offset + ts[i - 1].size)
      fail(ErrorKind::invalid_input, "optimizer tensors overlap at parameter {}", ts[i].offset);
  }
  // Each group cut at the tensors' bounds inside it: one piece per tensor (or gap).
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const size_t lo = groups_[gi].offset, hi = lo + groups_[gi].size;
    std::vector<size_t> cuts = {lo, hi};
    for (const TensorSpan& t : ts)
      for (size_t c : {t.offset, t.offset + t.size})
        if (c > lo && c < hi) cuts.push_back(c);
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    for (size_t k = 0; k + 1 < cuts.size(); ++k)
      segments_.push_back({cuts[k], cuts[k + 1] - cuts[k], gi, cuts[k + 1] - cuts[k] >= kMin8bitSize, 0, 0});
  }
  std::sort(segments_.begin(), segments_.end(), [](const Segment& a, const Segment& b) { return a.offset < b.offset; });
  for (Segment& s : segments_) {
    if (s.q8) {
      s.at = n_q8_;
      s.block = n_blocks_;
      n_q8_ += s.size;
      n_blocks_ += blockwise8_blocks(s.size);
    } else {
      s.at = n_f32_;
      n_f32_ += s.size;
    }
  }
}

// Drops the segments outside the shard and re-bases the kept ones' state
// offsets, remembering where they sit in the unsharded layout.
void AdamW::keep_shard() {
  all_f32_ = n_f32_, all_q8_ = n_q8_, all_blocks_ = n_blocks_;
  const size_t lo = shard_.begin, hi = shard_.end;
  if (lo == 0 && hi == n_) return;
  std::vector<Segment> kept;
  bool first_f32 = true, first_q8 = true;
  n_f32_ = n_q8_ = n_blocks_ = 0;
  if (kind_ == OptimizerKind::adamw) {  // moments mirror [lo, hi) of the arena; a group may be cut
    for (Segment s : segments_) {
      const size_t a = std::max(s.offset, lo), b = std::min(s.offset + s.size, hi);
      if (a >= b) continue;
      s.offset = a;
      s.size = b - a;
      s.at = a - lo;
      kept.push_back(s);
    }
    first_f32_ = lo;
    n_f32_ = hi - lo;
    segments_ = std::move(kept);
    return;
  }
  for (Segment s : segments_) {
    const size_t end = s.offset + s.size;
    if (end <= lo || s.offset >= hi) continue;
    if (s.offset < lo || end > hi)
      fail(ErrorKind::internal, "optimizer shard [{}, {}) cuts a tensor piece [{}, {})", lo, hi, s.offset, end);
    if (s.q8) {
      if (first_q8) first_q8_ = s.at, first_block_ = s.block, first_q8 = false;
      s.at -= first_q8_;
      s.block -= first_block_;
      n_q8_ += s.size;
      n_blocks_ += blockwise8_blocks(s.size);
    } else {
      if (first_f32) first_f32_ = s.at, first_f32 = false;
      s.at -= first_f32_;
      n_f32_ += s.size;
    }
    kept.push_back(s);
  }
  // An empty kind of piece starts where the next shard's would: after every earlier segment's.
  if (first_f32 || first_q8) {
    size_t f = 0, q = 0, bl = 0;
    for (const Segment& s : segments_) {
      if (s.offset >= lo) break;
      if (s.q8) q += s.size, bl += blockwise8_blocks(s.size);
      else f += s.size;
    }
    if (first_f32) first_f32_ = f;
    if (first_q8) first_q8_ = q, first_block_ = bl;
  }
  segments_ = std::move(kept);
}

void AdamW::set_sparse_gradients(bool on) {
  LOOM_ASSERT(!on || config_.sparse_gradients);
  sparse_now_ = on;
}

double AdamW::current_lr(size_t group) const {
  LOOM_ASSERT(group < groups_.size());
  return groups_[group].lr * schedule_.multiplier(step_) * lr_scale_;
}

StepStats AdamW::step(std::span<float> params, std::span<float> grads, std::optional<double> grad_norm) {
  LOOM_ASSERT(params.size() == n_ && grads.size() == n_);
  StepStats st;
  // torch's clip_grad_norm_: the norm in double, the coefficient in fp32, applied below 1.
  st.grad_norm = grad_norm ? *grad_norm : std::sqrt(be_.sum_squares(grads.data(), grads.size()));
  if (config_.max_grad_norm > 0) {
    st.clip_scale = clip_coefficient(st.grad_norm, config_.max_grad_norm);
    if (st.clip_scale < 1.0) be_.scale(grads.data(), static_cast<float>(st.clip_scale), static_cast<int64_t>(n_));
  }
  st.lr_multiplier = schedule_.multiplier(step_);
  ++step_;
  // Scalars in double as torch's Python floats, then used as fp32 like its kernels.
  const double t = static_cast<double>(step_);
  const double bc1 = 1.0 - std::pow(config_.beta1, t);
  AdamWUpdate u{};
  u.w1 = static_cast<float>(1.0 - config_.beta1);
  u.b2 = static_cast<float>(config_.beta2);
  u.w2 = static_cast<float>(1.0 - config_.beta2);
  u.eps = static_cast<float>(config_.eps);
  u.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(config_.beta2, t)));

  Adam8bitUpdate q{};
  q.b1 = static_cast<float>(config_.beta1);
  q.w1 = u.w1;
  q.b2 = u.b2;
  q.w2 = u.w2;
  q.eps = u.eps;
  q.bc2_sqrt = u.bc2_sqrt;
  const auto* maps = static_cast<const Blockwise8Map*>(maps_.data());
  for (const Segment& s : segments_) {
    const ParamGroup& g = groups_[s.group];
    const double lr = g.lr * st.lr_multiplier * lr_scale_;
    u.keep = q.keep = static_cast<float>(1.0 - lr * (g.decay ? g.weight_decay : 0.0));
    u.step_size = q.step_size = static_cast<float>(lr / bc1);
    float* p = params.data() + s.offset;
    const float* gr = grads.data() + s.offset;
    if (!s.q8 && sparse_now_) {
      be_.adamw_lazy_update({u, config_.beta1, config_.beta2}, p, gr, m_.floats() + s.at, v_.floats() + s.at,
                            gap_.floats() + s.at, s.size);
      continue;
    }
    if (!s.q8) {
      be_.adamw_update(u, p, gr, m_.floats() + s.at, v_.floats() + s.at, s.size);
      continue;
    }
    const Adam8bitState state{static_cast<uint8_t*>(mq_.data()) + s.at, ma_.floats() + s.block,
                              static_cast<uint8_t*>(vq_.data()) + s.at, va_.floats() + s.block, &maps[0], &maps[1]};
    be_.adamw8bit_update(q, p, gr, state, s.size);
  }
  return st;
}

std::vector<AdamW::StatePart> AdamW::state_parts() const {
  constexpr size_t F = sizeof(float);
  std::vector<StatePart> out = {{"adam_m.f32", m_.data(), n_f32_ * F, first_f32_ * F, all_f32_ * F},
                                {"adam_v.f32", v_.data(), n_f32_ * F, first_f32_ * F, all_f32_ * F}};
  if (config_.sparse_gradients)  // absent from checkpoints of runs without top-k
    out.push_back({"adam_gap.f32", gap_.data(), n_f32_ * F, first_f32_ * F, all_f32_ * F, /*zero_if_absent=*/true});
  if (kind_ == OptimizerKind::adamw8bit) {
    out.push_back({"adam_m.q8", mq_.data(), n_q8_, first_q8_, all_q8_});
    out.push_back({"adam_m_absmax.f32", ma_.data(), n_blocks_ * F, first_block_ * F, all_blocks_ * F});
    out.push_back({"adam_v.q8", vq_.data(), n_q8_, first_q8_, all_q8_});
    out.push_back({"adam_v_absmax.f32", va_.data(), n_blocks_ * F, first_block_ * F, all_blocks_ * F});
  }
  return out;
}

size_t AdamW::state_bytes() const {
  size_t n = maps_.bytes();
  for (const StatePart& p : state_parts()) n += p.bytes;
  return n;
}

namespace {
constexpr char kMagic[8] = {'L', 'O', 'O', 'M', 'A', 'D', 'A', 'M'};
constexpr uint32_t kVersion = 2;  // 1: adamw only, m and v without sizes
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8 + 8;  // magic, version, kind, n_params, step

template <typename T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
}  // namespace

void AdamW::save(const std::string& path) const {
  std::string out;
  out.reserve(kHeaderBytes + state_bytes() + 64);
  out.append(kMagic, 8);
  put(out, kVersion);
  put(out, static_cast<uint32_t>(kind_));
  put(out, static_cast<uint64_t>(n_));
  put(out, step_);
  for (const StatePart& p : state_parts()) {
    put(out, static_cast<uint64_t>(p.bytes));
    if (p.bytes) out.append(static_cast<const char*>(p.data), p.bytes);
  }
  put(out, fnv1a64(out));
  write_file_atomic(path, out);
}

void AdamW::load(const std::string& path) {
  const std::string bytes = read_text_file(path);
  if (bytes.size() < kHeaderBytes + 8 || std::memcmp(bytes.data(), kMagic, 8) != 0)
    fail(ErrorKind::invalid_input, "{}: not a loom optimizer state file (bad magic)", path);
  uint32_t version, kind;
  uint64_t n;
  int64_t step;
  std::memcpy(&version, bytes.data() + 8, 4);
  std::memcpy(&kind, bytes.data() + 12, 4);
  std::memcpy(&n, bytes.data() + 16, 8);
  std::memcpy(&step, bytes.data() + 24, 8);
  if (version != kVersion && version != 1)
    fail(ErrorKind::unsupported, "{}: optimizer state version {} (this build reads 1 and {})", path, version, kVersion);
  if (version == 1) kind = 0;  // adamw; the field was padding
  uint64_t stored;
  std::memcpy(&stored, bytes.data() + bytes.size() - 8, 8);
  if (stored != fnv1a64(std::string_view(bytes).substr(0, bytes.size() - 8)))
    fail(ErrorKind::invalid_input, "{}: checksum mismatch (file corrupted or truncated)", path);
  if (kind != static_cast<uint32_t>(kind_))
    fail(ErrorKind::invalid_input, "{}: optimizer state of optim.kind {}, this run uses {}", path,
         kind <= 1 ? optimizer_kind_name(static_cast<OptimizerKind>(kind)) : "?", optimizer_kind_name(kind_));
  if (n != n_)
    fail(ErrorKind::invalid_input, "{}: optimizer state has {} parameters, the model has {}", path, n, n_);
  if (step < 0) fail(ErrorKind::invalid_input, "{}: negative step counter {}", path, step);
  size_t at = kHeaderBytes;
  const size_t end = bytes.size() - 8;
  for (const StatePart& p : state_parts()) {
    uint64_t size = p.bytes;
    if (version != 1) {
      if (end - at < 8) fail(ErrorKind::invalid_input, "{}: ends before {} (truncated)", path, p.file);
      std::memcpy(&size, bytes.data() + at, 8);
      at += 8;
    }
    if (size != p.bytes || end - at < size)
      fail(ErrorKind::invalid_input, "{}: {} holds {} bytes, this optimizer has {} (another model or layout)", path,
           p.file, size, p.bytes);
    if (size) std::memcpy(p.data, bytes.data() + at, size);
    at += size;
  }
  if (at != end) fail(ErrorKind::invalid_input, "{}: {} bytes past the state (padded)", path, end - at);
  step_ = step;
}

}  // namespace loom
