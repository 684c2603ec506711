#include "model/ngram_proposer.h"

#include <algorithm>

#include "core/error.h"

namespace loom {

void validate_ngram_spec(const NgramSpecParams& p) {
  if (p.num_draft < 0 || p.num_draft > 64)
    fail(ErrorKind::invalid_input, "--spec-ngram must be in [0, 64] (got {})", p.num_draft);
  if (p.min_ngram < 1 || p.max_ngram > 64 || p.min_ngram > p.max_ngram)
    fail(ErrorKind::invalid_input,
         "--spec-ngram-min {} and --spec-ngram-max {} must satisfy 1 <= min <= max <= 64", p.min_ngram,
         p.max_ngram);
}

int64_t next_draft_length(const NgramSpecParams& p, int64_t accepted, int64_t drafted) {
  const int64_t next = accepted >= drafted ? 2 * drafted : accepted + 1;
  return std::clamp<int64_t>(next, 1, std::max<int32_t>(p.num_draft, 1));
}

void propose_ngram_drafts(std::span<const int32_t> tokens, const NgramSpecParams& p, int64_t max_draft,
                          std::vector<int32_t>& out) {
  out.clear();
  const auto L = static_cast<int64_t>(tokens.size());
  const int64_t k = std::min<int64_t>(p.num_draft, max_draft);
  if (k <= 0) return;
  for (int64_t n = std::min<int64_t>(p.max_ngram, L - 1); n >= p.min_ngram; --n) {
    const int32_t* suffix = tokens.data() + (L - n);
    // Most recent first: an occurrence starting at i is followed by tokens[i + n] (i + n < L).
    for (int64_t i = L - n - 1; i >= 0; --i) {
      if (!std::equal(suffix, suffix + n, tokens.data() + i)) continue;
      const int64_t from = i + n, to = std::min(L, from + k);
      out.assign(tokens.begin() + from, tokens.begin() + to);
      return;
    }
  }
}

}  // namespace loom
