// What the grammar mask needs from a tokenizer: every token's bytes in a TokenTrie (built once per model)
// and a request's end-of-generation tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "serve/engine_api.h"
#include "serve/grammar_matcher.h"
#include "tokenizer/tokenizer.h"

namespace loom {

// Special tokens (<|im_end|>, ...) are left out: they never spell grammar text.
std::unique_ptr<TokenTrie> make_token_trie(const Tokenizer& tok);

// The tokens that end `request`'s generation: the tokenizer's end-of-generation tokens and `extra_eos`
// (unless ignore_eos), and its stop_token_ids.
std::vector<int32_t> grammar_end_ids(const Tokenizer& tok, std::span<const int32_t> extra_eos,
                                     const GenerationRequest& request);

}  // namespace loom
