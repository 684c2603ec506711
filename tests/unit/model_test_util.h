// Helpers of the whole-model unit tests: logits comparison, greedy decoding through
// InferenceSession, and one greedy request through the serving engine.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/forward.h"
#include "model/peft_adapter.h"
#include "model/sampler.h"
#include "serve/scheduler.h"

namespace loom::test {

// The tiny llama's shapes (tests/fixtures/model/tiny-llama.f32.gguf).
inline ModelConfig tiny_llama_config() {
  ModelConfig c;
  c.arch = Arch::llama;
  c.vocab_size = 256;
  c.hidden = 64;
  c.intermediate = 176;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  c.max_context = 256;
  return c;
}

// max |a - b| / max |b|.
inline double relative_error(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num = std::max(num, static_cast<double>(std::fabs(a[i] - b[i])));
    den = std::max(den, static_cast<double>(std::fabs(b[i])));
  }
  return num / den;
}

// n greedy tokens from `logits` (the session's last position), fed back one by one.
inline std::vector<int32_t> greedy_ids(InferenceSession& s, const float* logits, size_t n) {
  SamplingParams p;
  p.temperature = 0;
  Sampler sampler(p, s.vocab_size());
  std::vector<int32_t> out;
  for (size_t i = 0; i < n; ++i) {
    const int32_t id = sampler.sample(logits, out);
    out.push_back(id);
    if (i + 1 < n) logits = s.eval(std::span<const int32_t>(&id, 1));
  }
  return out;
}

// A greedy request of exactly max_tokens tokens (EOS ignored) for `model`, the base
// or an adapter name, with the prompt given as token ids.
inline GenerationRequest greedy_request(const std::string& model, std::vector<int32_t> prompt,
                                        int64_t max_tokens) {
  GenerationRequest g;
  g.model = model;
  g.prompt.is_tokens = true;
  g.prompt.tokens = std::move(prompt);
  g.sampling.temperature = 0;
  g.sampling.top_k = 0;
  g.sampling.top_p = 1;
  g.sampling.min_p = 0;
  g.max_tokens = max_tokens;
  g.ignore_eos = true;
  return g;
}

// One greedy_request through the engine; fails the test on an error event or when
// no event comes within 60 s.
inline std::vector<int32_t> serve_greedy_ids(ServingEngine& e, const std::string& model,
                                             const std::vector<int32_t>& prompt, int64_t n) {
  auto stream = std::make_shared<RequestStream>();
  e.submit(greedy_request(model, prompt, n), stream);
  std::vector<int32_t> served;
  for (;;) {
    auto ev = stream->pop(std::chrono::seconds(60));
    if (!ev) {
      ADD_FAILURE() << "no event within 60 s";
      break;
    }
    if (ev->kind == GenerationEvent::Kind::error) {
      ADD_FAILURE() << (ev->error ? ev->error->what() : "error event");
      break;
    }
    if (ev->kind == GenerationEvent::Kind::done) break;
    served.insert(served.end(), ev->delta.token_ids.begin(), ev->delta.token_ids.end());
  }
  return served;
}

// A random rank-r PEFT adapter on every target of the tiny llama
// (tests/fixtures/model/tiny-llama.f32.gguf: 2 layers, hidden 64, 4 heads of
// 16, 2 kv heads, ffn 176), strong enough to change greedy output.
inline void write_tiny_random_adapter(const std::string& dir, uint32_t seed, int64_t r = 4) {
  peft::AdapterTensors ad;
  ad.config.r = r;
  ad.config.lora_alpha = 8;
  ad.config.base_model_name_or_path = "tiny-llama";
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  const std::pair<int64_t, int64_t> io[] = {{64, 64}, {64, 32}, {64, 32}, {64, 64}, {64, 176}, {64, 176}, {176, 64}};
  for (LoraTarget t : kAllLoraTargets) ad.config.target_modules.push_back(t);
  for (int l = 0; l < 2; ++l)
    for (int t = 0; t < kLoraTargetCount; ++t) {
      peft::LoraPair p;
      p.in = io[t].first;
      p.out = io[t].second;
      p.a.resize(static_cast<size_t>(r * p.in));
      p.b.resize(static_cast<size_t>(p.out * r));
      for (float& v : p.a) v = nd(rng);
      for (float& v : p.b) v = nd(rng);
      ad.pairs.emplace(std::make_pair(l, static_cast<LoraTarget>(t)), std::move(p));
    }
  peft::write_adapter(dir, ad);
}

}  // namespace loom::test
