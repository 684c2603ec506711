// Token sampling: penalties, then top-k, top-p, min-p, temperature and a
// seeded draw (llama.cpp's default order). temperature <= 0 means greedy.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/rng.h"

namespace loom {

struct SamplingParams {
  float temperature = 0.8f;
  int32_t top_k = 40;          // <= 0: whole vocabulary
  float top_p = 0.95f;         // 1: off
  float min_p = 0.05f;         // 0: off
  float repeat_penalty = 1.0f; // 1: off (llama.cpp style: divide positive logits, multiply negative)
  int32_t repeat_last_n = 64;  // tokens of history the penalties look at; -1: all
  float presence_penalty = 0.0f;   // OpenAI style: logit -= presence * (count > 0) + frequency * count
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;
};

// Throws invalid_input naming the parameter when a value is out of range.
void validate_sampling(const SamplingParams& p);

class Sampler {
 public:
  Sampler(const SamplingParams& params, int64_t vocab_size);
  // `history`: tokens so far (prompt and generated), for the penalties.
  // `draft` (>= 0): a token proposed for this position by a deterministic
  // drafter (prompt lookup): when sampling, it is kept with probability p(draft)
  // and otherwise a token is drawn from p without it (speculative sampling,
  // Leviathan et al. 2023, with a one-hot draft distribution): the result has
  // the distribution of a plain draw. Greedy ignores it.
  int32_t sample(const float* logits, std::span<const int32_t> history, int32_t draft = -1);

  struct Candidate {
    int32_t id;
    float logit;
    float prob;
  };
 private:
  // Temperature sampling over the whole vocabulary (no top-k, top-p or min-p
  // filter), without sorting it.
  int32_t sample_unfiltered(int32_t draft);
  // One uniform draw: whether a draft of probability draft_mass / total is
  // kept (else the caller draws from the rest).
  bool keep_draft(double draft_mass, double total);

  SamplingParams p_;
  int64_t vocab_;
  CounterRng rng_;
  std::vector<float> work_;
  std::vector<Candidate> cand_;
  std::vector<int32_t> counts_;
};

}  // namespace loom
