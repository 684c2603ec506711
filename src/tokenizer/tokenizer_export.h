// Writes a loaded Tokenizer back out as Hugging Face files (tokenizer.json,
// tokenizer_config.json), so that a model exported from a GGUF file can be
// loaded by loom and by transformers without the original tokenizer files.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "tokenizer/tokenizer.h"

namespace loom {

// The tokenizer.json document (HF `tokenizers` format) that reloads to the same
// ids: BPE model (vocab, merges, byte_fallback/fuse_unk/ignore_merges), added
// tokens, and the normalizer / pre-tokenizer / decoder steps loom runs, with a
// post-processor adding BOS/EOS when the tokenizer adds them. Throws
// unsupported (naming the tokenizer and its kind) when an added token's id
// cannot be reproduced by the id rule of HF's loader.
nlohmann::ordered_json tokenizer_json_of(const Tokenizer& tok);

// tokenizer_config.json: bos/eos/unk/pad tokens, add_bos_token/add_eos_token,
// model_max_length (omitted when max_length <= 0), tokenizer_class
// PreTrainedTokenizerFast, and the chat template: `chat_template` when given
// (an empty string writes none), else the tokenizer's own one if it has one.
nlohmann::ordered_json tokenizer_config_of(const Tokenizer& tok,
                                           const std::optional<std::string>& chat_template,
                                           int64_t max_length);

// Writes tokenizer.json and tokenizer_config.json into `dir` (created if
// missing), each atomically. Throws loom::Error (io, unsupported).
void write_tokenizer_files(const Tokenizer& tok, const std::optional<std::string>& chat_template,
                           int64_t max_length, const std::string& dir);

}  // namespace loom
