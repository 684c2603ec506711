// Prompt-lookup drafts for speculative decoding (llama.cpp's `--spec-type
// ngram`, vLLM's "ngram" method): the tokens that followed the most recent
// earlier occurrence of the sequence's last n tokens. `loom generate` and
// `loom serve` verify them with one forward over [last token, drafts].
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace loom {

struct NgramSpecParams {
  int32_t num_draft = 0;  // k: most tokens proposed per step; 0: speculation off
  int32_t max_ngram = 3;  // longest suffix looked up (vLLM's prompt_lookup_max)
  int32_t min_ngram = 2;  // shortest (prompt_lookup_min)
  bool enabled() const { return num_draft > 0; }
};

// Throws invalid_input naming the flag for values out of range (num_draft in [0, 64],
// 1 <= min_ngram <= max_ngram <= 64).
void validate_ngram_spec(const NgramSpecParams& p);

// Writes into `out` up to min(p.num_draft, max_draft) tokens: for n from
// p.max_ngram down to p.min_ngram, the first n whose last-n-tokens suffix of
// `tokens` occurs earlier in `tokens` gives the tokens after its most recent
// such occurrence (fewer when that occurrence is near the end). Empty when no
// suffix occurs earlier: the caller then decodes one token as usual.
// The draft length of a sequence's next step after a verification that accepted `accepted` of `drafted`
// tokens: twice the draft (up to p.num_draft) when all were accepted, else one more than were accepted. A
// text that stops repeating itself then costs one extra row per step rather than num_draft.
int64_t next_draft_length(const NgramSpecParams& p, int64_t accepted, int64_t drafted);

void propose_ngram_drafts(std::span<const int32_t> tokens, const NgramSpecParams& p, int64_t max_draft,
                          std::vector<int32_t>& out);

}  // namespace loom
