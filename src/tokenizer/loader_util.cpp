// Helpers shared by the tokenizer loaders (see loader_util.h).
#include "tokenizer/loader_util.h"

#include <algorithm>
#include <array>

namespace loom::tok {

int32_t find_token(const TokenizerSpec& spec, std::string_view text) {
  for (const AddedToken& t : spec.added_tokens)
    if (t.content == text) return t.id;
  for (size_t i = spec.vocab.size(); i-- > 0;)
    if (spec.vocab[i] == text) return static_cast<int32_t>(i);
  return -1;
}

void add_known_eog_tokens(TokenizerSpec& spec) {
  static constexpr std::array<std::string_view, 8> kEndTokens = {
      "<|im_end|>",      "<|eot_id|>",    "<|eom_id|>", "<|endoftext|>",
      "<|end_of_text|>", "<end_of_turn>", "<|end|>",    "</s>"};
  for (const AddedToken& t : spec.added_tokens) {
    if (!t.special) continue;
    if (std::find(kEndTokens.begin(), kEndTokens.end(), t.content) == kEndTokens.end()) continue;
    if (std::find(spec.eog_ids.begin(), spec.eog_ids.end(), t.id) == spec.eog_ids.end())
      spec.eog_ids.push_back(t.id);
  }
}

TokenizerKind infer_kind(const TokenizerSpec& spec) {
  for (const auto& p : spec.pre_tokenizers)
    if (p.kind == PreTokenizerStep::Kind::byte_level) return TokenizerKind::byte_level_bpe;
  for (const auto& d : spec.decoders)
    if (d.kind == DecoderStep::Kind::byte_level) return TokenizerKind::byte_level_bpe;
  if (spec.byte_fallback) return TokenizerKind::spm_bpe;
  for (const auto& p : spec.pre_tokenizers)
    if (p.kind == PreTokenizerStep::Kind::metaspace) return TokenizerKind::spm_bpe;
  return TokenizerKind::bpe;
}

}  // namespace loom::tok
