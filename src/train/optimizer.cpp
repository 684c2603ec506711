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
             LrSchedule schedule)
    : config_(config),
      groups_(std::move(groups)),
      schedule_(schedule),
      be_(backend),
      n_(n_params),
      m_(backend.alloc(n_params * sizeof(float))),
      v_(backend.alloc(n_params * sizeof(float))) {
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
  for (const auto& g : groups_) {
    const double lr = g.lr * st.lr_multiplier * lr_scale_;
    u.keep = static_cast<float>(1.0 - lr * (g.decay ? g.weight_decay : 0.0));
    u.step_size = static_cast<float>(lr / bc1);
    be_.adamw_update(u, params.data() + g.offset, grads.data() + g.offset, m_.floats() + g.offset,
                     v_.floats() + g.offset, g.size);
  }
  return st;
}

namespace {
constexpr char kMagic[8] = {'L', 'O', 'O', 'M', 'A', 'D', 'A', 'M'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8 + 8;  // magic, version, pad, n_params, step

template <typename T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
}  // namespace

void AdamW::save(const std::string& path) const {
  std::string out;
  out.reserve(kHeaderBytes + 8 * n_ + 8);
  out.append(kMagic, 8);
  put(out, kVersion);
  put(out, uint32_t{0});
  put(out, static_cast<uint64_t>(n_));
  put(out, step_);
  out.append(reinterpret_cast<const char*>(m_.data()), n_ * sizeof(float));
  out.append(reinterpret_cast<const char*>(v_.data()), n_ * sizeof(float));
  put(out, fnv1a64(out));
  write_file_atomic(path, out);
}

void AdamW::load(const std::string& path) {
  const std::string bytes = read_text_file(path);
  const size_t want = kHeaderBytes + 8 * n_ + 8;
  if (bytes.size() < kHeaderBytes || std::memcmp(bytes.data(), kMagic, 8) != 0)
    fail(ErrorKind::invalid_input, "{}: not a loom optimizer state file (bad magic)", path);
  uint32_t version;
  uint64_t n;
  int64_t step;
  std::memcpy(&version, bytes.data() + 8, 4);
  std::memcpy(&n, bytes.data() + 16, 8);
  std::memcpy(&step, bytes.data() + 24, 8);
  if (version != kVersion)
    fail(ErrorKind::unsupported, "{}: optimizer state version {} (this build reads {})", path, version, kVersion);
  if (n != n_)
    fail(ErrorKind::invalid_input, "{}: optimizer state has {} parameters, the model has {}", path, n, n_);
  if (bytes.size() != want)
    fail(ErrorKind::invalid_input, "{}: size {} bytes, expected {} (truncated or padded)", path, bytes.size(), want);
  uint64_t stored;
  std::memcpy(&stored, bytes.data() + want - 8, 8);
  if (stored != fnv1a64(std::string_view(bytes).substr(0, want - 8)))
    fail(ErrorKind::invalid_input, "{}: checksum mismatch (file corrupted)", path);
  if (step < 0) fail(ErrorKind::invalid_input, "{}: negative step counter {}", path, step);
  std::memcpy(m_.data(), bytes.data() + kHeaderBytes, 4 * n);
  std::memcpy(v_.data(), bytes.data() + kHeaderBytes + 4 * n, 4 * n);
  step_ = step;
}

}  // namespace loom
