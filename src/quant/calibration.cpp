#include "quant/calibration.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/mapped_file.h"
#include "model/model.h"
#include "quant/observed_chunks.h"
#include "tokenizer/tokenizer.h"

namespace loom {
namespace {

class StatsCollector final : public LayerAdapters {
 public:
  StatsCollector(const ModelConfig& c, CalibrationStats& out, int64_t sample_every, int64_t max_samples)
      : c_(c), out_(out), every_(sample_every), max_samples_(max_samples) {
    out_.layers.resize(static_cast<size_t>(c.n_layers));
    out_.residual_cosine.assign(static_cast<size_t>(c.n_layers), 0.0);
    for (auto& layer : out_.layers)
      for (LoraTarget t : {LoraTarget::q, LoraTarget::o, LoraTarget::gate, LoraTarget::down}) {
        ChannelStats& s = layer[static_cast<size_t>(adapter_point_of(t))];
        s.width = lora_target_in(c, t);
        s.min.assign(static_cast<size_t>(s.width), std::numeric_limits<float>::infinity());
        s.max.assign(static_cast<size_t>(s.width), -std::numeric_limits<float>::infinity());
        s.abs_sum.assign(static_cast<size_t>(s.width), 0.0);
        s.sq_sum.assign(static_cast<size_t>(s.width), 0.0);
      }
  }

  void apply(int64_t layer, std::span<const AdapterJob> jobs) override {
    const AdapterJob& j = jobs.front();  // every job of a point reads the same x
    ChannelStats& s = out_.layers[static_cast<size_t>(layer)][static_cast<size_t>(adapter_point_of(j.target))];
    const int64_t n = s.width;
    for (int64_t r = 0; r < j.rows; ++r) {
      const float* x = j.x + r * j.ldx;
      for (int64_t i = 0; i < n; ++i) {
        s.min[static_cast<size_t>(i)] = std::min(s.min[static_cast<size_t>(i)], x[i]);
        s.max[static_cast<size_t>(i)] = std::max(s.max[static_cast<size_t>(i)], x[i]);
        s.abs_sum[static_cast<size_t>(i)] += std::fabs(x[i]);
        s.sq_sum[static_cast<size_t>(i)] += static_cast<double>(x[i]) * x[i];
      }
      // s.tokens + r: the token's index in the whole text (points see every row, in order).
      if (max_samples_ > 0 && (s.tokens + r) % every_ == 0 && s.sample_rows() < max_samples_)
        s.samples.insert(s.samples.end(), x, x + n);
    }
    s.tokens += j.rows;
  }

  void residual(int64_t layer, const float* x, int64_t T) override {
    const int64_t H = c_.hidden;
    if (layer > 0) {
      double& sum = out_.residual_cosine[static_cast<size_t>(layer - 1)];
      for (int64_t t = 0; t < T; ++t) sum += cosine(prev_.data() + t * H, x + t * H, H);
    }
    if (layer == c_.n_layers) {
      out_.residual_tokens += T;
      return;
    }
    prev_.assign(x, x + T * H);
  }

 private:
  static double cosine(const float* a, const float* b, int64_t n) {
    double ab = 0, aa = 0, bb = 0;
    for (int64_t i = 0; i < n; ++i) {
      ab += static_cast<double>(a[i]) * b[i];
      aa += static_cast<double>(a[i]) * a[i];
      bb += static_cast<double>(b[i]) * b[i];
    }
    return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : 1.0;
  }

  const ModelConfig& c_;
  CalibrationStats& out_;
  std::vector<float> prev_;  // the residual entering the previous layer
  int64_t every_, max_samples_;
};

}  // namespace

AdapterPoint adapter_point_of(LoraTarget t) {
  switch (t) {
    case LoraTarget::q: case LoraTarget::k: case LoraTarget::v: return AdapterPoint::qkv;
    case LoraTarget::o: return AdapterPoint::o;
    case LoraTarget::gate: case LoraTarget::up: return AdapterPoint::gate_up;
    case LoraTarget::down: return AdapterPoint::down;
  }
  return AdapterPoint::qkv;
}

CalibrationStats collect_calibration(InferenceSession& session, const ModelConfig& config,
                                     std::span<const int32_t> tokens, const CalibrationOptions& opt,
                                     const std::function<void(int64_t, int64_t)>& on_chunk) {
  const int64_t n_ctx = opt.n_ctx;
  if (n_ctx < 1 || session.n_ctx() < n_ctx)
    fail(ErrorKind::invalid_input, "calibration: a chunk of {} tokens does not fit the session ({})", n_ctx,
         session.n_ctx());
  int64_t n_chunks = static_cast<int64_t>(tokens.size()) / n_ctx;
  if (opt.max_chunks >= 0) n_chunks = std::min(n_chunks, opt.max_chunks);
  if (n_chunks < 1)
    fail(ErrorKind::invalid_input, "the calibration text tokenizes to {} tokens, less than one chunk of {}",
         tokens.size(), n_ctx);
  CalibrationStats stats;
  stats.chunk_size = n_ctx;
  const int64_t total = n_chunks * n_ctx;
  const int64_t every = opt.max_samples > 0 ? std::max<int64_t>(1, total / opt.max_samples) : 1;
  StatsCollector collector(config, stats, every, opt.max_samples);
  run_observed_chunks(session, tokens, n_ctx, n_chunks, opt.bos, collector, [&](int64_t c, int64_t n) {
    stats.chunks = c;
    if (on_chunk) on_chunk(c, n);
  });
  return stats;
}

CalibrationStats calibrate_on_text(const std::string& model_path, Backend& backend, const std::string& text_file,
                                   CalibrationOptions opt, const std::function<void(const std::string&)>& log) {
  auto model = Model::load(model_path, {.tokenizer = true, .pack = true, .backend = &backend});
  const Tokenizer& tok = model->tokenizer();
  const auto tokens = tok.encode(read_text_file(text_file), true, false);
  opt.n_ctx = std::min<int64_t>(opt.n_ctx, model->config().max_context);
  opt.bos = tok.add_bos() ? tok.bos() : -1;
  InferenceSession session(model->config(), model->weights(), backend, opt.n_ctx);
  if (log) log(fmt::format("calibration: {} tokens in {}, chunks of {}", tokens.size(), text_file, opt.n_ctx));
  return collect_calibration(session, model->config(), tokens, opt, nullptr);
}

}  // namespace loom
