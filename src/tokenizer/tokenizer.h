// Text <-> token ids, exact to Hugging Face `tokenizers`: byte-level BPE
// (GPT-2, Llama 3, Qwen2, SmolLM2 pre-tokenizers) and SentencePiece-style BPE
// with byte fallback (Llama 2, Mistral), loaded from GGUF metadata or from
// tokenizer.json. A Tokenizer is immutable and safe to share between threads.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/spec.h"

namespace loom {

namespace gguf {
class File;
}

class Tokenizer {
 public:
  // Validates `spec` (ids, merges, added tokens, regexes) and builds the tables.
  // Throws loom::Error naming spec.name and the offending field.
  static Tokenizer from_spec(TokenizerSpec spec);
  // From tokenizer.* metadata (tokenizer.ggml.model "gpt2" or "llama").
  static Tokenizer from_gguf(const gguf::File& file);
  static TokenizerSpec spec_from_gguf(const gguf::File& file);
  // From a tokenizer.json file (and the parsed tokenizer_config.json beside it,
  // which may set bos/eos tokens, add_bos_token/add_eos_token and the chat template).
  static Tokenizer from_tokenizer_json(const std::string& path,
                                       const std::optional<nlohmann::json>& tokenizer_config = std::nullopt);
  static TokenizerSpec spec_from_tokenizer_json(const nlohmann::json& tokenizer_json,
                                                const std::optional<nlohmann::json>& tokenizer_config,
                                                const std::string& name);

  // `add_special`: add the BOS/EOS the tokenizer's post-processor adds.
  // `parse_special`: recognise special tokens ("<|im_start|>") in the text; when
  // false they are encoded as plain text (non-special added tokens still match).
  // Invalid UTF-8 in `text` is read as U+FFFD, as Python would.
  std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special) const;

  // Text of `ids` as Hugging Face's decode() gives it (its decoder chain; invalid
  // UTF-8 becomes U+FFFD). Throws invalid_input for an id out of range.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;
  // The bytes one token stands for on its own ("▁the" -> " the", <0x0A> -> "\n",
  // a special token -> its text); may be part of a UTF-8 character.
  std::string token_to_piece(int32_t id) const;
  // The token as written in the vocabulary ("Ġthe", "<0x0A>"); empty for an unused id.
  const std::string& token_text(int32_t id) const;
  // Id of a token text (vocabulary or added token), -1 if there is none.
  int32_t token_id(std::string_view text) const;

  int32_t vocab_size() const;
  int32_t bos() const;  // -1 if none
  int32_t eos() const;  // -1 if none
  bool add_bos() const;
  bool is_special(int32_t id) const;
  bool is_eog(int32_t id) const;  // end of generation: eos or an end-of-turn token
  TokenizerKind kind() const;
  const char* kind_name() const;
  const std::string& chat_template() const;  // empty if the model has none
  const TokenizerSpec& spec() const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
  friend class StreamDecoder;
};

// Turns generated ids into text as they arrive. The concatenation of what
// push() and finish() return equals tokenizer.decode(all ids, skip_special)
// whenever that text is valid (byte tokens spelling invalid UTF-8 may come out
// as a different number of U+FFFD); text is held back while it ends in an
// unfinished UTF-8 character. Keeps a reference to `tok`.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = true);
  std::string push(int32_t id);
  std::string finish();

 private:
  std::string emit(bool force);

  const Tokenizer& tok_;
  bool skip_special_;
  // Once text has started, pending ids are decoded behind an anchor token (a
  // plain letter) so that start-of-text rules (a stripped leading space) and
  // byte-fallback runs behave as they do in the middle of a full decode.
  int32_t anchor_ = -1;
  std::string anchor_text_;
  bool started_ = false;
  std::vector<int32_t> pending_;
};

}  // namespace loom
