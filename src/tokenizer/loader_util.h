// Helpers shared by the tokenizer.json and GGUF loaders.
#pragma once

#include <string_view>

#include "tokenizer/spec.h"

namespace loom::tok {

// Adds to spec.eog_ids the special added tokens that end a turn or a text in
// the model families loom knows (<|im_end|>, <|eot_id|>, <|endoftext|>, ...).
void add_known_eog_tokens(TokenizerSpec& spec);

// Id of an added token with this content, or of a vocabulary token; -1 if none.
int32_t find_token(const TokenizerSpec& spec, std::string_view text);

// Infers spec.kind from the pipeline steps.
TokenizerKind infer_kind(const TokenizerSpec& spec);

}  // namespace loom::tok
