// Greedy continuations of loom against llama.cpp's (llama-simple) text for the
// same file: identical, except at a step where the top two logits are so close
// (a near tie, below kNearTie) that the two implementations' different rounding
// can swap them; such a step is reported with its margin and ends the comparison.
// loom runs with an f32 KV cache here: this checks the arithmetic, and on files
// with 8-bit activations the f16 cache's rounding moves logits as much as any
// float-level difference does (tests/model/test_kv_cache_f16.cpp checks it alone).
#pragma once

#include <gtest/gtest.h>

#include "kernels/backend.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/forward.h"
#include "model/model.h"
#include "model/sampler.h"
#include "tokenizer/tokenizer.h"

namespace loom {

inline constexpr float kNearTie = 0.1f;

// The text on one line (the chat prompts' newlines as \n), for the log.
inline std::string one_line(const std::string& text) {
  std::string out;
  for (char ch : text) out += ch == '\n' ? std::string("\\n") : std::string(1, ch);
  return out;
}

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

struct GreedyAgreement {
  int exact = 0;   // prompts identical for all tokens
  int agreed = 0;  // tokens identical before each prompt's divergence (an identical prompt counts n_predict)
  int tokens = 0;  // n_predict per prompt
};

// Runs every case ({"prompt", "continuation"}) for n_predict greedy tokens. A divergence
// with a margin >= near_tie fails.
inline GreedyAgreement expect_greedy_agreement(const Model& model, Backend& backend,
                                               const nlohmann::json& cases, int n_predict,
                                               const std::string& label, float near_tie = kNearTie) {
  const Tokenizer& tok = model.tokenizer();
  GreedyAgreement r;
  for (const auto& c : cases) {
    const std::string prompt = c["prompt"], want = c["continuation"];
    SCOPED_TRACE(label + ": " + one_line(prompt));
    InferenceSession s(model.config(), model.weights(), backend, 256, DType::f32);
    const float* logits = s.eval(tok.encode(prompt, true, true));
    SamplingParams sp;
    sp.temperature = 0;
    Sampler sampler(sp, s.vocab_size());
    std::string got;
    std::vector<float> margins;
    for (int i = 0; i < n_predict; ++i) {
      const int32_t id = sampler.sample(logits, {});
      margins.push_back(top2_margin(logits, s.vocab_size()));
      // An end-of-generation token diverges where llama.cpp's text goes on.
      const bool end = tok.is_eog(id);
      const std::string next = end ? got : got + tok.token_to_piece(id);
      if (end ? next != want : want.compare(0, next.size(), next) != 0) {
        // The texts are compared, not the tokens (llama-simple prints text): a token
        // that is a strict prefix of llama.cpp's (' ' against ' approximately') only
        // shows as a divergence at a later token, so the decision that split them is
        // one of the last kSplitLag tokens: the one with the smallest margin.
        constexpr int kSplitLag = 3;
        int at = i;
        for (int j = i; j >= 0 && j > i - kSplitLag; --j)
          if (margins[static_cast<size_t>(j)] < margins[static_cast<size_t>(at)]) at = j;
        const float m = margins[static_cast<size_t>(at)];
        std::printf(
            "[ llama.cpp agreement ] %s '%s': diverges by token %d (top-2 logit margin %.4f at token %d)\n",
            label.c_str(), one_line(prompt).c_str(), i, m, at);
        EXPECT_LT(m, near_tie) << "token " << at << ": loom continues '" << one_line(next) << "', llama.cpp '"
                               << one_line(want) << "' with a top-2 margin of " << m;
        r.agreed += i;
        got.clear();
        break;
      }
      if (end) break;
      got = next;
      logits = s.eval(std::span<const int32_t>(&id, 1));
    }
    r.tokens += n_predict;
    if (got == want) {
      ++r.exact;
      r.agreed += n_predict;
    }
  }
  std::printf(
      "[ llama.cpp agreement ] %s: %d of %zu prompts identical for %d tokens; %d of %d tokens before the "
      "divergences\n",
      label.c_str(), r.exact, cases.size(), n_predict, r.agreed, r.tokens);
  return r;
}

}  // namespace loom
