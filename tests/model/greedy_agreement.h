// Greedy continuations of loom against llama.cpp's (llama-simple) text for the
// same file: identical, except at a step where the top two logits are so close
// (a near tie, below kNearTie) that the two implementations' different rounding
// can swap them; such a step is reported with its margin and ends the comparison.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "model/forward.h"
#include "model/model.h"
#include "model/sampler.h"
#include "tokenizer/tokenizer.h"

namespace loom {

inline constexpr float kNearTie = 0.1f;

// Top-1 minus top-2 logit.
inline float top2_margin(const float* logits, int64_t V) {
  float a = -INFINITY, b = -INFINITY;
  for (int64_t i = 0; i < V; ++i) {
    if (logits[i] > a) {
      b = a;
      a = logits[i];
    } else if (logits[i] > b) {
      b = logits[i];
    }
  }
  return a - b;
}

// Runs every case ({"prompt", "continuation"}) for n_predict greedy tokens; returns how
// many were identical for all tokens. A divergence with a margin >= kNearTie fails.
inline int expect_greedy_agreement(const Model& model, ThreadPool& pool, const nlohmann::json& cases,
                                   int n_predict, const std::string& label) {
  const Tokenizer& tok = model.tokenizer();
  int exact = 0;
  for (const auto& c : cases) {
    const std::string prompt = c["prompt"], want = c["continuation"];
    SCOPED_TRACE(label + ": " + prompt);
    InferenceSession s(model.config(), model.weights(), pool, 256);
    const float* logits = s.eval(tok.encode(prompt, true, true));
    SamplingParams sp;
    sp.temperature = 0;
    Sampler sampler(sp, s.vocab_size());
    std::string got;
    for (int i = 0; i < n_predict; ++i) {
      const int32_t id = sampler.sample(logits, {});
      if (tok.is_eog(id)) break;
      const std::string next = got + tok.token_to_piece(id);
      if (want.compare(0, next.size(), next) != 0) {
        const float m = top2_margin(logits, s.vocab_size());
        std::printf("[ llama.cpp agreement ] %s '%s': diverges at token %d (top-2 logit margin %.4f)\n",
                    label.c_str(), prompt.c_str(), i, m);
        EXPECT_LT(m, kNearTie) << "token " << i << ": loom continues '" << next << "', llama.cpp '" << want
                               << "' with a top-2 margin of " << m;
        got.clear();
        break;
      }
      got = next;
      logits = s.eval(std::span<const int32_t>(&id, 1));
    }
    if (got == want) ++exact;
  }
  std::printf("[ llama.cpp agreement ] %s: %d of %zu prompts identical for %d tokens\n", label.c_str(), exact,
              cases.size(), n_predict);
  return exact;
}

}  // namespace loom
